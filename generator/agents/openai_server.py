"""The generator's OpenAI-compatible chat-completions endpoint, for agents written against the OpenAI API.

It serves `POST /v1/chat/completions` (plain and `stream=true`) and `GET /v1/models` on 127.0.0.1, from the
generator's own engine, in the generator's event loop (uvicorn, started on a socket bound here). Each episode is
a session: the API key the agent's client sends (`Authorization: Bearer <session id>`) names it, so any harness
that takes a base URL and a key works unchanged. Requests are turned into one token sequence per session by
`AgentSession` (openai_session.py), which records the exact ids, logprobs and versions sampled. A streamed reply
is sent token by token from an engine that offers it (base.StreamingEngine: vLLM), in one chunk from any other
(openai_stream.py says how the text is cut and tool calls held back).

Sampling is the job's (`rollout.temperature`, `top_p`, `top_k`: the policy being trained); the request's own
sampling parameters are ignored, `max_tokens` / `max_completion_tokens` can only lower `rollout.max_tokens`, and
`n` must be 1. Errors come back as OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`, the
`code` one of openai_session.REFUSAL_CAUSES): 401 for an unknown session, 400 for a request the episode cannot take
(with the reason), 409 for a second concurrent request in one session. Each refusal is counted in
`rollout/http_refusals/<cause>`, and each tool call the model got wrong in `rollout/tool_errors/<reason>`.

A reply whose only tool calls the model got wrong (tool_calls.py: malformed, unknown tool, bad arguments) ends with
finish_reason MALFORMED_TOOL_CALL, its text as the content: the agent sees that the model tried and failed, which
"stop" would hide. The official `openai` client passes the value through (tests/integration/test_openai_endpoint.py).
"""
import asyncio
import json
import logging
import socket
import time
from collections import Counter
from contextlib import aclosing
from dataclasses import replace

from asyncrl.generator.agents.openai_session import SessionRefused
from asyncrl.generator.agents.openai_stream import ChunkWriter, TextDeltas, closing_chunks, usage_asked
from asyncrl.generator.engines.base import StreamingEngine

log = logging.getLogger(__name__)


MALFORMED_TOOL_CALL = "malformed_tool_call"
"""The finish_reason of a reply in which the model wrote tool calls and got every one of them wrong."""


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict:
    """OpenAI's error object; `code` is the refusal's cause (openai_session.REFUSAL_CAUSES)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def stream_usage(body: dict) -> bool:
    """Whether a streamed reply ends with a usage chunk (`stream_options.include_usage`); refuses a bad value."""
    try:
        return usage_asked(body)
    except ValueError as err:
        raise SessionRefused(400, str(err), "bad_parameter", "stream_options") from None


def requested_max_tokens(body: dict, default: int) -> int:
    """The request's max_completion_tokens (or the older max_tokens), else `default`; a value that is present
    must be a positive integer (0 is refused like -5, not read as unset)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SessionRefused(400, f"{key} must be a positive integer, got {value!r}", "bad_parameter", key)
        return value
    return default


class OpenAIEndpoint:
    """`sessions` (id -> AgentSession), served on `url` once `start()` has run."""

    def __init__(self, engine, model_name: str, sampling, port: int = 0):
        self.engine, self.model_name, self.sampling, self.port = engine, model_name, sampling, port
        self.sessions: dict = {}
        self.refusals: Counter = Counter()  # cause -> requests refused
        self.tool_errors: Counter = Counter()  # reason -> tool calls the model got wrong
        self._server = None
        self._task = None
        self.url = ""

    def build_app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import StreamingResponse

        app = FastAPI(title="asyncrl generator", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "asyncrl"}]}

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            session = self.sessions.get(request.headers.get("authorization", "").removeprefix("Bearer ").strip())
            if session is None:
                return self.refuse("unknown session: the API key names the episode", "authentication_error",
                                   "unknown_key", 401)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                return self.refuse("the body is not JSON", "invalid_request_error", "bad_body")
            if not isinstance(body, dict):
                return self.refuse("the body must be a JSON object", "invalid_request_error", "bad_body")
            if session.busy:
                return self.refuse("this episode already has a request in flight: an episode's requests are "
                                   "answered one at a time", "conflict", "concurrent_request", 409)
            session.busy = True
            streaming, mark, requests = False, session.mark(), session.requests
            try:
                if body.get("stream"):
                    include_usage = stream_usage(body)
                    prompt, sampling = self._prepare(session, body)
                    streaming = True  # from here the stream releases the session when it ends
                    return StreamingResponse(self._stream(session, prompt, sampling, include_usage, mark),
                                             media_type="text/event-stream")
                return await self._complete(session, body)
            except SessionRefused as err:
                return self.refuse(str(err), "invalid_request_error", err.cause, err.status, err.param)
            finally:
                if not streaming:
                    if session.requests == requests:  # no turn recorded: the request leaves no trace
                        session.undo(mark)
                    session.busy = False

        return app

    def refuse(self, message: str, kind: str, cause: str, status: int = 400, param: str | None = None):
        """Count the refusal by cause and answer it as an OpenAI error object."""
        from fastapi.responses import JSONResponse

        self.refusals[cause] += 1
        log.info("refused an agent request (%s): %s", cause, message)
        return JSONResponse(error_body(message, kind, cause, param), status)

    def metrics(self) -> dict:
        return {**{f"rollout/http_refusals/{cause}": float(count) for cause, count in sorted(self.refusals.items())},
                **{f"rollout/tool_errors/{reason}": float(count) for reason, count in sorted(self.tool_errors.items())}}

    async def _complete(self, session, body: dict) -> dict:
        prompt, sampling = self._prepare(session, body)
        (completion,) = await self.engine.sample(prompt, sampling, 1)
        return self._reply(session, prompt, completion)

    def _prepare(self, session, body: dict) -> tuple[list, object]:
        """The prompt ids and sampling of the request's next turn; raises SessionRefused."""
        if body.get("n") is not None and (isinstance(body["n"], bool) or body["n"] != 1):
            raise SessionRefused(400, f"n must be 1: each episode is one sequence, got {body.get('n')!r}",
                                 "bad_parameter", "n")
        asked = requested_max_tokens(body, session.max_tokens)
        prompt = session.sequence_for(body.get("messages"), body.get("tools"))
        room = min(asked, session.room())
        if room < 1:
            raise SessionRefused(400, "the episode has no tokens left", "token_budget")
        sampling = self.sampling if room == self.sampling.max_tokens else replace(self.sampling, max_tokens=room)
        return prompt, sampling

    def _reply(self, session, prompt: list, completion) -> dict:
        """Record the sampled turn in the session and answer it as a chat.completion."""
        message, errors = session.record(completion)
        self.tool_errors.update(errors)
        if completion.finish_reason != "stop":  # cut: no turn may follow (after_cut), calls or not
            finish = "length"
        elif message.get("tool_calls"):
            finish = "tool_calls"
        else:
            finish = MALFORMED_TOOL_CALL if errors else "stop"
        return {"id": f"chatcmpl-{session.id}-{session.requests}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion.token_ids),
                          "total_tokens": len(prompt) + len(completion.token_ids)}}

    async def _stream(self, session, prompt: list, sampling, include_usage: bool, mark: tuple):
        """The turn as server-sent chunks (openai_stream.py): token by token from a StreamingEngine, in one chunk
        at the end from any other. The session is released when the stream ends, however it ends; a client that
        goes away mid-turn aborts the engine's request, and the turn is not recorded (the session is back at
        `mark`, so the same request can be sent again)."""
        requests = session.requests
        writer = ChunkWriter(f"chatcmpl-{session.id}-{session.requests + 1}", int(time.time()), self.model_name)
        deltas = TextDeltas(session.tokenizer, session.parser.open_tag if session.tools else None)
        try:
            yield writer.choice({"role": "assistant", "content": ""})
            completion = None
            if isinstance(self.engine, StreamingEngine):
                async with aclosing(self.engine.sample_stream(prompt, sampling)) as growing:
                    async for completion in growing:
                        text = deltas.feed(completion.token_ids)
                        if text:
                            yield writer.choice({"content": text})
            else:
                (completion,) = await self.engine.sample(prompt, sampling, 1)
            if completion is None:
                raise RuntimeError("the engine's stream ended without a completion")
            reply = self._reply(session, prompt, completion)
            message = reply["choices"][0]["message"]
            if not (message.get("content") or "").startswith(deltas.sent):
                # streamed text the reply's own differs from (a tool-call reply that began with whitespace): the
                # client holds what it was sent, so that is the reply the episode expects back
                message["content"] = deltas.sent or (None if message.get("tool_calls") else "")
                session.returned(message)
            for event in closing_chunks(writer, reply, deltas.sent, include_usage):
                yield event
            yield "data: [DONE]\n\n"
        except Exception as err:  # noqa: BLE001 - told to the client as OpenAI's stream error, never a crash
            log.warning("an agent's streamed turn failed: %s: %s", type(err).__name__, err)
            yield ChunkWriter.event(error_body(f"the turn failed: {type(err).__name__}: {err}", "server_error",
                                               "engine_error"))
        finally:
            if session.requests == requests:
                session.undo(mark)
            session.busy = False

    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        config = uvicorn.Config(self.build_app(), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
