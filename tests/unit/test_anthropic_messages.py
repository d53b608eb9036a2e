"""The Anthropic <-> chat translation (generator/agents/anthropic_messages.py): a Messages request becomes the chat
request an OpenAI agent would send for the same conversation, a reply goes back as blocks that translate to the
message the session recorded, and what cannot be honoured is refused naming the field."""
import json

import pytest

from asyncrl.generator.agents.anthropic_messages import anthropic_error, anthropic_message, chat_request
from asyncrl.generator.agents.anthropic_stream import MessageEvents
from asyncrl.generator.agents.openai_session import SessionRefused, canonical

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_conversation_with_tools_becomes_the_chat_request_an_openai_agent_sends():
    body = {"model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "be brief", "cache_control": {}}],
            "tools": [{"name": "neg", "description": "Negate.", "input_schema": SCHEMA}],
            "messages": [
                {"role": "user", "content": "negate 2"},
                {"role": "assistant", "content": [{"type": "text", "text": "ok", "citations": None},
                                                  {"type": "tool_use", "id": "t1", "name": "neg", "input": {"a": 2}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "-2"},
                                             {"type": "text", "text": "and 3?"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t2", "name": "neg", "input": {"a": 3}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                              "content": [{"type": "text", "text": "busy"}]}]}]}
    assert chat_request(body) == {"max_tokens": 16, "tools": [
        {"type": "function", "function": {"name": "neg", "description": "Negate.", "parameters": SCHEMA}}],
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "negate 2"},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "neg", "arguments": '{"a": 2}'}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "-2"},
            {"role": "user", "content": "and 3?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "t2", "type": "function", "function": {"name": "neg", "arguments": '{"a": 3}'}}]},
            {"role": "tool", "tool_call_id": "t2", "content": "Error: busy"}]}


def test_a_reply_sent_back_as_its_blocks_is_the_message_the_session_recorded():
    """The session compares canonical messages (role, text, tool calls): the reply's blocks, returned as the
    next request's assistant turn, must translate to exactly what the endpoint answered."""
    recorded = {"role": "assistant", "content": "adding", "tool_calls": [
        {"id": "call_x_1_0", "type": "function",
         "function": {"name": "add", "arguments": json.dumps({"b": 3, "a": 2})}}]}
    reply = {"id": "chatcmpl-k-1", "model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 4},
             "choices": [{"message": recorded, "finish_reason": "tool_calls"}]}
    message = anthropic_message(reply)
    assert message == {"id": "msg_k-1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
                       "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 4}, "content": [
                           {"type": "text", "text": "adding"},
                           {"type": "tool_use", "id": "call_x_1_0", "name": "add", "input": {"b": 3, "a": 2}}]}
    back = chat_request({"max_tokens": 1, "messages": [{"role": "assistant", "content": message["content"]}]})
    assert canonical(back["messages"][0]) == canonical(recorded)
    for finish, stop in (("stop", "end_turn"), ("length", "max_tokens"),
                         ("malformed_tool_call", "malformed_tool_call")):
        empty = {**reply, "choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": finish}]}
        assert anthropic_message(empty)["stop_reason"] == stop and anthropic_message(empty)["content"] == []


@pytest.mark.parametrize("change, param, cause, words", [
    ({"max_tokens": 0}, "max_tokens", "bad_parameter", "positive integer, got 0"),
    ({"max_tokens": None}, "max_tokens", "bad_parameter", "max_tokens is required"),
    ({"max_tokens": True}, "max_tokens", "bad_parameter", "positive integer, got True"),
    ({"stop_sequences": ["x"]}, "stop_sequences", "bad_parameter", "not supported"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "bad_parameter", "not supported"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "bad_parameter", "auto"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "bad_parameter", "server tools"),
    ({"messages": []}, "messages", "bad_messages", "non-empty"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "bad_messages", "'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0]", "bad_messages",
     "'image' block"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}]}, "messages[0]",
     "bad_messages", "thinking blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "1"}]}]},
     "messages[0].content[0]", "bad_messages", "tool_use_id"),
    ({"system": [{"type": "image"}]}, "system", "bad_messages", "text block"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(change, param, cause, words):
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(SessionRefused) as refused:
        chat_request(body)
    assert (refused.value.status, refused.value.cause, refused.value.param) == (400, cause, param)
    assert words in str(refused.value)


def test_ignored_fields_change_nothing_and_errors_are_anthropics():
    base = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    extra = {**base, "temperature": 0.2, "top_k": 3, "metadata": {"user_id": "u"}, "tool_choice": {"type": "auto"},
             "thinking": {"type": "disabled"}, "stop_sequences": [], "system": ""}
    assert chat_request(extra) == chat_request(base) == {"max_tokens": 8, "tools": None,
                                                         "messages": [{"role": "user", "content": "hi"}]}
    assert anthropic_error("no", "authentication_error", "unknown_key", 401, None) == {
        "type": "error", "error": {"type": "authentication_error", "message": "no", "cause": "unknown_key",
                                   "param": None}}
    edited = anthropic_error("messages[1] differs", "invalid_request_error", "history_edited", 400, "messages")
    assert edited["error"]["type"] == "invalid_request_error" and "system prompt is messages[0]" in \
        edited["error"]["message"]


def events_of(stream: list[str]) -> list[tuple[str, dict]]:
    out = []
    for item in stream:
        name, data = item.strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append((payload["type"], payload))
    return out


def test_stream_events_come_in_anthropics_order():
    """Text deltas in block 0, the rest of the text, then each tool call as its own block, then the stop."""
    events = MessageEvents("chatcmpl-k-2", "m")
    reply = {"id": "chatcmpl-k-2", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 9},
             "choices": [{"finish_reason": "tool_calls", "message": {
                 "role": "assistant", "content": "ab c", "tool_calls": [
                     {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}}]}
    stream = events.start(5) + events.text("ab") + events.finish(reply, "ab")
    got = events_of(stream)
    assert [name for name, _ in got] == ["message_start", "content_block_start", "content_block_delta",
                                         "content_block_delta", "content_block_stop", "content_block_start",
                                         "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert got[0][1]["message"]["id"] == "msg_k-2" and got[0][1]["message"]["usage"]["input_tokens"] == 5
    assert [payload["delta"]["text"] for name, payload in got[2:4]] == ["ab", " c"]
    assert got[5][1] == {"type": "content_block_start", "index": 1,
                         "content_block": {"type": "tool_use", "id": "c0", "name": "f", "input": {}}}
    assert got[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"x": 1}'}
    assert got[8][1]["delta"]["stop_reason"] == "tool_use" and got[8][1]["usage"]["output_tokens"] == 9
    only_call = MessageEvents("chatcmpl-k-3", "m")
    reply["choices"][0]["message"]["content"] = None
    names = [name for name, _ in events_of(only_call.start(5) + only_call.finish(reply, ""))]
    assert names[1:4] == ["content_block_start", "content_block_delta", "content_block_stop"]  # block 0: the call
    assert events_of([MessageEvents.error(anthropic_error("x", "server_error", "engine_error", 500, None))])[0][1][
        "error"]["type"] == "api_error"
