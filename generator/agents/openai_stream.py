"""Streaming a chat completion as OpenAI's server-sent chunks, token by token from an engine that grows its
completion (base.StreamingEngine: vLLM), in one chunk at the end from any other engine.

Text is decoded incrementally from the token ids the engine sampled: the growing list is decoded whole and the
new suffix sent, so a multi-byte character split across tokens is held back (its trailing U+FFFD) until it is
complete. The ids are never re-tokenized; the completion is recorded by AgentSession.record exactly as it would
be without streaming.

When the request offers tools, text that may be a tool call is not streamed as content: from the first opening
marker (the session parser's `open_tag`, `<tool_call>` for tool_calls.HermesToolCallParser) on, and a trailing
part of it, nothing more is sent until the turn ends; trailing whitespace waits too, since a reply with calls has
its text stripped. At the end the calls go out in OpenAI's tool_calls delta format, then what is left of the
content, the finish_reason, and, when `stream_options.include_usage` asks, a chunk with empty choices and the
usage. The content the client put
together from the deltas is what the episode expects back in the next request's history.
"""
import json

class TextDeltas:
    """The new text of a growing token list, never a broken character, and never a tool call that opens with
    `marker` (None: the request offers no tools).

    Decoding the whole list at every delta would cost the event loop O(n^2) on a long reply, so text settles a
    `window` of tokens at a time once it lies `window` tokens back; only the tokens after it are decoded again,
    with CONTEXT tokens before them (as vLLM's detokenizer does: some decoders, SentencePiece's, drop a word's
    leading space at the start of a decode)."""

    CONTEXT = 4

    def __init__(self, tokenizer, marker: str | None, window: int = 64):
        self.tokenizer, self.marker, self.window = tokenizer, marker, window
        self.sent = ""
        self.settled, self.base = "", 0  # the text of token_ids[:base], which no later token changes

    def feed(self, token_ids: list) -> str:
        """The text to send now for `token_ids` (all of the turn's ids so far)."""
        return self.take(self.safe_text(self.text_of(token_ids)))

    def text_of(self, token_ids: list) -> str:
        """The decoded text of `token_ids`, as one decode of them all would give it."""
        while len(token_ids) - self.base > 2 * self.window:
            for end in range(self.base + self.window, self.base + self.window + 4):  # UTF-8: at most 4 bytes
                piece = self.decoded_after(token_ids, self.base, end)
                if piece is not None and not piece.endswith("\ufffd"):  # not a character cut at the edge
                    break
            else:
                break  # it does not settle (a byte that is no character): decode from here on
            self.settled, self.base = self.settled + piece, end
        rest = self.decoded_after(token_ids, self.base, len(token_ids))
        if rest is None:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return self.settled + rest

    def decoded_after(self, token_ids: list, start: int, end: int) -> str | None:
        """The text token_ids[start:end] add after token_ids[:start]; None when the context decodes differently
        alone than in front of them (then nothing is settled)."""
        left = max(0, start - self.CONTEXT)
        before = self.tokenizer.decode(token_ids[left:start], skip_special_tokens=True)
        whole = self.tokenizer.decode(token_ids[left:end], skip_special_tokens=True)
        return whole[len(before):] if whole.startswith(before) else None

    def safe_text(self, text: str) -> str:
        text = text.rstrip("\ufffd")  # an incomplete multi-byte character decodes to U+FFFD until it completes
        marker = self.marker
        if not marker:
            return text
        at = text.find(marker)
        if at >= 0:
            text = text[:at]
        else:
            for size in range(len(marker) - 1, 0, -1):
                if text.endswith(marker[:size]):
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


class CompletionEvents:
    """The chunks of one streamed chat completion, as the endpoint's stream loop asks for them (the same calls
    as anthropic_stream.MessageEvents: start, text, finish, error)."""

    def __init__(self, writer: ChunkWriter, include_usage: bool):
        self.writer, self.include_usage = writer, include_usage

    def start(self, prompt_tokens: int) -> list[str]:
        return [self.writer.choice({"role": "assistant", "content": ""})]

    def text(self, delta: str) -> list[str]:
        return [self.writer.choice({"content": delta})]

    def finish(self, reply: dict, sent: str) -> list[str]:
        return [*closing_chunks(self.writer, reply, sent, self.include_usage), "data: [DONE]\n\n"]

    @staticmethod
    def error(body: dict) -> str:
        return ChunkWriter.event(body)
