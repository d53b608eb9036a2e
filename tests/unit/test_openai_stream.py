"""Incremental decoding for the agent endpoint's stream: the new text of a growing token list, never half a
multi-byte character, never the start of a tool call; and stream_options read strictly."""
import pytest

from asyncrl.generator.agents.openai_stream import TextDeltas, usage_asked


class ByteTokenizer:
    """One token per UTF-8 byte, decoded as a byte-level BPE tokenizer decodes a cut character: U+FFFD."""

    @staticmethod
    def encode(text: str) -> list:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids, skip_special_tokens=True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, marker) -> tuple[list, TextDeltas]:
    ids, deltas = ByteTokenizer.encode(text), TextDeltas(ByteTokenizer(), marker)
    pieces = [deltas.feed(ids[:end]) for end in range(1, len(ids) + 1)]
    return [piece for piece in pieces if piece], deltas


def test_multi_byte_characters_are_sent_whole_once_their_last_byte_is_in():
    pieces, deltas = stream("café → 5 ✓", marker=None)
    assert "".join(pieces) == "café → 5 ✓" == deltas.sent
    assert all("\ufffd" not in piece for piece in pieces) and len(pieces) == len("café → 5 ✓")


def test_with_tools_the_text_from_a_tool_call_marker_on_is_held_back():
    pieces, deltas = stream('adding <tool_call>{"name": "add"}</tool_call> done', marker="<tool_call>")
    assert "".join(pieces) == "adding" == deltas.sent  # trailing space waits: a reply with calls is stripped
    held = TextDeltas(ByteTokenizer(), marker="<tool_call>")
    assert held.feed(ByteTokenizer.encode("sum <tool")) == "sum"
    assert held.feed(ByteTokenizer.encode("sum <b>")) == " <b>"  # not a marker after all: sent
    assert stream("a <tool_call>", marker=None)[1].sent == "a <tool_call>"


def test_stream_options_are_read_strictly():
    assert usage_asked({}) is False and usage_asked({"stream_options": {"include_usage": True}}) is True
    for bad in ({"stream_options": "yes"}, {"stream_options": {"include_usage": 1}}):
        with pytest.raises(ValueError, match="stream_options"):
            usage_asked(bad)


def test_windowed_decoding_gives_the_text_one_decode_of_all_the_tokens_gives():
    """Text settles a window at a time (so a long reply is not decoded whole at every token), including across
    multi-byte characters cut at a window's edge, and with a real tokenizer whose decode drops a leading space."""
    from tests.chat_tokenizer import chat_tokenizer

    text = "é" * 9 + " tri ✓ x" * 7
    ids = ByteTokenizer.encode(text)
    deltas = TextDeltas(ByteTokenizer(), marker=None, window=3)
    assert "".join(deltas.feed(ids[:end]) for end in range(1, len(ids) + 1)) == text and deltas.base > 0
    tokenizer = chat_tokenizer()
    words = " the sum is five, or 5 " * 6
    ids = tokenizer(words, add_special_tokens=False)["input_ids"]
    deltas = TextDeltas(tokenizer, marker=None, window=5)
    assert "".join(deltas.feed(ids[:end]) for end in range(1, len(ids) + 1)) == \
        tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd") and deltas.base > 0
