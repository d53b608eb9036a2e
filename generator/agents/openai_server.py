"""The generator's OpenAI-compatible chat-completions endpoint, for agents written against the OpenAI API, and
Anthropic's Messages API beside it.

It serves `POST /v1/chat/completions` (plain and `stream=true`), `POST /v1/messages` (Anthropic's, plain and
streamed: anthropic_messages.py translates it to a chat request and back, anthropic_stream.py writes its events)
and `GET /v1/models` on 127.0.0.1, from the generator's own engine, in the generator's event loop (uvicorn,
started on a socket bound here). Each episode is a session: the API key the agent's client sends
(`Authorization: Bearer <session id>`, or Anthropic's `x-api-key`) names it, so any harness that takes a base URL
and a key works unchanged. Requests of both APIs are turned into one token sequence per session by the same
`AgentSession` (openai_session.py), which records the exact ids, logprobs and versions sampled. A streamed reply
is sent token by token from an engine that offers it (base.StreamingEngine: vLLM), in one chunk from any other
(openai_stream.py says how the text is cut and tool calls held back).

Sampling is the job's (`rollout.temperature`, `top_p`, `top_k`: the policy being trained); the request's own
sampling parameters are ignored, `max_tokens` / `max_completion_tokens` can only lower `rollout.max_tokens`, and
`n` must be 1. Errors come back as OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`, the
`code` one of openai_session.REFUSAL_CAUSES), on /v1/messages as Anthropic's (`{"type": "error", "error":
{"type", "message", "cause", "param"}}`): 401 for an unknown session, 400 for a request the episode cannot take
(with the reason), 409 for a second concurrent request in one session. Each refusal is counted in
`rollout/http_refusals/<cause>`, and each tool call the model got wrong in `rollout/tool_errors/<reason>`.

A reply whose only tool calls the model got wrong (tool_calls.py: malformed, unknown tool, bad arguments) ends with
finish_reason MALFORMED_TOOL_CALL, its text as the content: the agent sees that the model tried and failed, which
"stop" would hide. The official `openai` client passes the value through (tests/integration/test_openai_endpoint.py).
A client that validates finish_reason against OpenAI's own values (verifiers' interception does) sends the header
`X-Asyncrl-Finish-Reason: standard` and gets "stop" there instead; the tool errors are counted all the same.
"""
import asyncio
import json
import logging
import socket
import time
from collections import Counter
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Callable

from asyncrl.generator.agents.anthropic_messages import anthropic_error, anthropic_message, chat_request
from asyncrl.generator.agents.anthropic_stream import MessageEvents
from asyncrl.generator.agents.openai_session import SessionRefused
from asyncrl.generator.agents.openai_stream import ChunkWriter, CompletionEvents, TextDeltas, usage_asked
from asyncrl.generator.engines.base import StreamingEngine

log = logging.getLogger(__name__)


MALFORMED_TOOL_CALL = "malformed_tool_call"
"""The finish_reason of a reply in which the model wrote tool calls and got every one of them wrong."""

FINISH_REASON_HEADER = "x-asyncrl-finish-reason"
"""A request with this header set to `standard` gets only OpenAI's finish reasons ("stop" for MALFORMED_TOOL_CALL)."""


def standard_finish_reasons(headers) -> bool:
    """Whether the client asked for OpenAI's finish reasons only; any other value of the header is refused."""
    value = headers.get(FINISH_REASON_HEADER)
    if value is None:
        return False
    if value.strip().lower() != "standard":
        raise SessionRefused(400, f"the {FINISH_REASON_HEADER} header may only be 'standard', got {value!r}",
                             "bad_parameter", FINISH_REASON_HEADER)
    return True


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict:
    """OpenAI's error object; `code` is the refusal's cause (openai_session.REFUSAL_CAUSES)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error(message: str, kind: str, cause: str, status: int, param: str | None) -> dict:
    return error_body(message, kind, cause, param)


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


def session_key(headers) -> str:
    """The API key of a request: Anthropic's `x-api-key`, else the `Authorization: Bearer` token."""
    return (headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")).strip()


def completion_events(body: dict, reply_id: str, model: str) -> CompletionEvents:
    return CompletionEvents(ChunkWriter(reply_id, int(time.time()), model), stream_usage(body))


def message_events(body: dict, reply_id: str, model: str) -> MessageEvents:
    return MessageEvents(reply_id, model)


@dataclass(frozen=True)
class Dialect:
    """What differs between the APIs the endpoint speaks; everything else (the session, its history checks, the
    engine call, the recording, the refusal counts) is shared."""

    request: Callable  # the request body -> the chat-completions body; raises SessionRefused
    reply: Callable  # the chat.completion -> this API's reply
    events: Callable  # (body, reply id, model) -> the stream's events; raises SessionRefused
    error: Callable  # (message, OpenAI error type, cause, status, param) -> this API's error object


OPENAI = Dialect(request=lambda body: body, reply=lambda reply: reply, events=completion_events, error=openai_error)
ANTHROPIC = Dialect(request=chat_request, reply=anthropic_message, events=message_events, error=anthropic_error)


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

        app = FastAPI(title="asyncrl generator", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "asyncrl"}]}

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self.serve_turn(request, OPENAI)

        @app.post("/v1/messages")
        async def messages(request: Request):
            return await self.serve_turn(request, ANTHROPIC)

        return app

    async def serve_turn(self, request, dialect: Dialect):
        """One request of an episode in `dialect`'s API: a reply, a stream, or a counted refusal. A request
        whose turn is not recorded leaves no trace in the session (a streamed one: when its stream ends)."""
        from fastapi.responses import StreamingResponse

        session = self.sessions.get(session_key(request.headers))
        if session is None:
            return self.refuse(dialect, "unknown session: the API key names the episode", "authentication_error",
                               "unknown_key", 401)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self.refuse(dialect, "the body is not JSON", "invalid_request_error", "bad_body")
        if not isinstance(body, dict):
            return self.refuse(dialect, "the body must be a JSON object", "invalid_request_error", "bad_body")
        if session.busy:
            return self.refuse(dialect, "this episode already has a request in flight: an episode's requests are "
                               "answered one at a time", "conflict", "concurrent_request", 409)
        session.busy = True
        streaming, mark, requests = False, session.mark(), session.requests
        try:
            standard = standard_finish_reasons(request.headers)
            chat = dialect.request(body)
            if body.get("stream"):
                reply_id = f"chatcmpl-{session.id}-{session.requests + 1}"
                events = dialect.events(body, reply_id, self.model_name)
                prompt, sampling = self._prepare(session, chat)
                streaming = True  # from here the stream releases the session when it ends
                return StreamingResponse(self._stream(session, prompt, sampling, events, dialect, mark, standard),
                                         media_type="text/event-stream")
            return dialect.reply(await self._complete(session, chat, standard))
        except SessionRefused as err:
            return self.refuse(dialect, str(err), "invalid_request_error", err.cause, err.status, err.param)
        finally:
            if not streaming:
                if session.requests == requests:  # no turn recorded: the request leaves no trace
                    session.undo(mark)
                session.busy = False

    def refuse(self, dialect: Dialect, message: str, kind: str, cause: str, status: int = 400,
               param: str | None = None):
        """Count the refusal by cause and answer it as the dialect's error object."""
        from fastapi.responses import JSONResponse

        self.refusals[cause] += 1
        log.info("refused an agent request (%s): %s", cause, message)
        return JSONResponse(dialect.error(message, kind, cause, status, param), status)

    def metrics(self) -> dict:
        return {**{f"rollout/http_refusals/{cause}": float(count) for cause, count in sorted(self.refusals.items())},
                **{f"rollout/tool_errors/{reason}": float(count) for reason, count in sorted(self.tool_errors.items())}}

    async def _complete(self, session, body: dict, standard: bool = False) -> dict:
        prompt, sampling = self._prepare(session, body)
        (completion,) = await self.engine.sample(prompt, sampling, 1)
        return self._reply(session, prompt, completion, standard)

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

    def _reply(self, session, prompt: list, completion, standard: bool = False) -> dict:
        """Record the sampled turn in the session and answer it as a chat.completion (with OpenAI's finish
        reasons only when `standard`)."""
        message, errors = session.record(completion)
        self.tool_errors.update(errors)
        if completion.finish_reason != "stop":  # cut: no turn may follow (after_cut), calls or not
            finish = "length"
        elif message.get("tool_calls"):
            finish = "tool_calls"
        else:
            finish = MALFORMED_TOOL_CALL if errors and not standard else "stop"
        return {"id": f"chatcmpl-{session.id}-{session.requests}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion.token_ids),
                          "total_tokens": len(prompt) + len(completion.token_ids)}}

    async def _stream(self, session, prompt: list, sampling, events, dialect: Dialect, mark: tuple,
                      standard: bool = False):
        """The turn as server-sent `events` (openai_stream.CompletionEvents, anthropic_stream.MessageEvents):
        token by token from a StreamingEngine, in one piece at the end from any other. The session is released
        when the stream ends, however it ends; a client that goes away mid-turn aborts the engine's request, and
        the turn is not recorded (the session is back at `mark`, so the same request can be sent again)."""
        requests = session.requests
        deltas = TextDeltas(session.tokenizer, session.parser.open_tag if session.tools else None)
        try:
            for item in events.start(len(prompt)):
                yield item
            completion = None
            if isinstance(self.engine, StreamingEngine):
                async with aclosing(self.engine.sample_stream(prompt, sampling)) as growing:
                    async for completion in growing:
                        text = deltas.feed(completion.token_ids)
                        if text:
                            for item in events.text(text):
                                yield item
            else:
                (completion,) = await self.engine.sample(prompt, sampling, 1)
            if completion is None:
                raise RuntimeError("the engine's stream ended without a completion")
            reply = self._reply(session, prompt, completion, standard)
            message = reply["choices"][0]["message"]
            if not (message.get("content") or "").startswith(deltas.sent):
                # streamed text the reply's own differs from (a tool-call reply that began with whitespace): the
                # client holds what it was sent, so that is the reply the episode expects back
                message["content"] = deltas.sent or (None if message.get("tool_calls") else "")
                session.returned(message)
            for item in events.finish(reply, deltas.sent):
                yield item
        except Exception as err:  # noqa: BLE001 - told to the client as the API's stream error, never a crash
            log.warning("an agent's streamed turn failed: %s: %s", type(err).__name__, err)
            yield events.error(dialect.error(f"the turn failed: {type(err).__name__}: {err}", "server_error",
                                             "engine_error", 500, None))
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
