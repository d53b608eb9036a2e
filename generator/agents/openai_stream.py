"""Streaming a chat completion as OpenAI's server-sent chunks, token by token from an engine that grows its
completion (base.StreamingEngine: vLLM), in one chunk at the end from any other engine.

Text is decoded incrementally from the token ids the engine sampled: the growing list is decoded whole and the
new suffix sent, so a multi-byte character split across tokens is held back (its trailing U+FFFD) until it is
complete. The ids are never re-tokenized; the completion is recorded by AgentSession.record exactly as it would
be without streaming.

When the request offers tools, text that may be a tool call is not streamed as content: from the first opening
marker (tool_calls.HermesToolCallParser.open_tag) on, and a trailing part of it, nothing more is sent until the
turn ends; trailing whitespace waits too, since a reply with calls has its text stripped. At the end the calls go
out in OpenAI's tool_calls delta format, then what is left of the content, the finish_reason, and, when
`stream_options.include_usage` asks, a chunk with empty choices and the usage. The content the client put
together from the deltas is what the episode expects back in the next request's history.
"""
import json
import logging

log = logging.getLogger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
"""The opening marker of a tool call in the model's text (HermesToolCallParser.open_tag)."""


class TextDeltas:
    """The new text of a growing token list, never a broken character, and (`hold_tools`) never a tool call."""

    def __init__(self, tokenizer, hold_tools: bool):
        self.tokenizer, self.hold_tools = tokenizer, hold_tools
        self.sent = ""

    def feed(self, token_ids: list) -> str:
        """The text to send now for `token_ids` (all of the turn's ids so far)."""
        return self.take(self.safe_text(self.tokenizer.decode(token_ids, skip_special_tokens=True)))

    def safe_text(self, text: str) -> str:
        text = text.rstrip("\ufffd")  # an incomplete multi-byte character decodes to U+FFFD until it completes
        if not self.hold_tools:
            return text
        at = text.find(TOOL_CALL_OPEN)
        if at >= 0:
            text = text[:at]
        else:
            for size in range(len(TOOL_CALL_OPEN) - 1, 0, -1):
                if text.endswith(TOOL_CALL_OPEN[:size]):
                    text = text[:-size]
                    break
        return text.rstrip()

    def take(self, text: str) -> str:
        """The part of `text` not sent yet; nothing when earlier text decoded differently (the end puts it right)."""
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


def usage_asked(body: dict) -> bool:
    """`stream_options.include_usage` of a request; raises ValueError naming what is wrong with it."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ValueError(f"stream_options must be an object, got {options!r}")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise ValueError(f"stream_options.include_usage must be true or false, got {value!r}")
    return value


class ChunkWriter:
    """OpenAI's `chat.completion.chunk` events of one reply."""

    def __init__(self, reply_id: str, created: int, model: str):
        self.base = {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def choice(self, delta: dict, finish_reason: str | None = None) -> str:
        return self.event({**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                                     "logprobs": None}]})

    def usage(self, usage: dict) -> str:
        return self.event({**self.base, "choices": [], "usage": usage})

    @staticmethod
    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"


def closing_chunks(writer: ChunkWriter, reply: dict, sent: str, include_usage: bool) -> list[str]:
    """What follows the streamed text once the reply is known: the tool calls, the rest of the content, the
    finish and the usage. `sent`: the content already streamed."""
    choice = reply["choices"][0]
    message = choice["message"]
    events = []
    if message.get("tool_calls"):
        events.append(writer.choice({"tool_calls": [{"index": index, **call}
                                                    for index, call in enumerate(message["tool_calls"])]}))
    rest = (message.get("content") or "")[len(sent):]
    if rest:
        events.append(writer.choice({"content": rest}))
    events.append(writer.choice({}, choice["finish_reason"]))
    if include_usage:
        events.append(writer.usage(reply["usage"]))
    return events
