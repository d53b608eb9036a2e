"""The agent endpoint's refusal messages and parameter checks, as pure functions: a history that differs is told
by the index of the first message that differs and what was expected there, an omitted reply as an omission,
and a max_tokens that is present must be a positive integer (0 is not "unset"). The endpoint that sends them:
tests/integration/test_openai_endpoint.py."""
import pytest

from asyncrl.generator.agents.openai_server import error_body, requested_max_tokens
from asyncrl.generator.agents.openai_session import REFUSAL_CAUSES, SessionRefused, canonical, history_mismatch

USER = canonical({"role": "user", "content": "what is 2+3?"})
REPLY = canonical({"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]})
TOOL = canonical({"role": "tool", "content": "5", "tool_call_id": "call_1"})
REPLY2 = canonical({"role": "assistant", "content": "5"})
HISTORY = [USER, REPLY, TOOL, REPLY2]
REPLIES = {1: 1, 3: 2}


def test_a_history_repeated_exactly_is_no_mismatch():
    assert history_mismatch(HISTORY, HISTORY, REPLIES) is None
    assert history_mismatch([*HISTORY, canonical({"role": "user", "content": "thanks"})], HISTORY, REPLIES) is None


def test_an_edited_reply_is_told_by_index_and_turn_with_what_was_expected():
    rebuilt = canonical({"role": "assistant", "content": "the sum is 5"})
    cause, message = history_mismatch([USER, REPLY, TOOL, rebuilt], HISTORY, REPLIES)
    assert cause == "history_edited"
    assert message.startswith("messages[3] (assistant) differs from the reply this episode's turn 2 returned: "
                              "expected {role 'assistant', content '5'}, got {role 'assistant', content 'the sum "
                              "is 5'}")


def test_edited_tool_call_arguments_are_shown():
    wrong = canonical({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 4}'}}]})
    cause, message = history_mismatch([USER, wrong, TOOL], HISTORY, REPLIES)
    assert cause == "history_edited" and "turn 1" in message
    assert 'tool calls add({"a": 2, "b": 3})' in message and 'tool calls add({"a": 2, "b": 4})' in message


def test_an_edited_message_the_agent_sent_is_told_as_such():
    cause, message = history_mismatch([canonical({"role": "user", "content": "what is 2+4?"}), REPLY], HISTORY,
                                      REPLIES)
    assert cause == "history_edited"
    assert message.startswith("messages[0] (user) differs from what this episode was sent there: expected {role "
                              "'user', content 'what is 2+3?'}, got {role 'user', content 'what is 2+4?'}")


def test_a_reply_left_out_is_an_omission_not_an_edit():
    cause, message = history_mismatch([USER, REPLY, TOOL, canonical({"role": "user", "content": "and?"})], HISTORY,
                                      REPLIES)
    assert cause == "reply_omitted"
    assert message.startswith("the request omits the assistant reply of turn 2 (expected messages[3] to be it, "
                              "{role 'assistant', content '5'}; got {role 'user', content 'and?'})")
    cause, message = history_mismatch([USER, REPLY, TOOL], HISTORY, REPLIES)  # cut just before it
    assert cause == "reply_omitted" and "got nothing" in message


def test_a_history_cut_short_before_a_sent_message_names_it():
    cause, message = history_mismatch([USER, REPLY], HISTORY, REPLIES)
    assert cause == "history_edited"
    assert message.startswith("the request stops at messages[1]: it leaves out messages[2], expected {role 'tool', "
                              "content '5'}")


def test_long_content_is_cut_in_the_message():
    long = canonical({"role": "assistant", "content": "x" * 500})
    _, message = history_mismatch([USER, long], HISTORY, REPLIES)
    assert "x" * 80 + "..." in message and "x" * 81 not in message


@pytest.mark.parametrize("body, expected", [({}, 64), ({"max_tokens": 8}, 8), ({"max_completion_tokens": 4}, 4),
                                            ({"max_completion_tokens": 4, "max_tokens": 8}, 4),
                                            ({"max_tokens": None}, 64)])
def test_max_tokens_lowers_the_default(body, expected):
    assert requested_max_tokens(body, 64) == expected


@pytest.mark.parametrize("body, param", [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
                                         ({"max_completion_tokens": 0}, "max_completion_tokens"),
                                         ({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
                                         ({"max_tokens": "8"}, "max_tokens")])
def test_a_max_tokens_that_is_not_a_positive_integer_is_refused_naming_it(body, param):
    with pytest.raises(SessionRefused) as caught:
        requested_max_tokens(body, 64)
    assert (caught.value.status, caught.value.cause, caught.value.param) == (400, "bad_parameter", param)
    assert str(caught.value).startswith(f"{param} must be a positive integer, got {body[param]!r}")


def test_refusals_carry_a_known_cause_in_openais_error_shape():
    with pytest.raises(ValueError, match="not one of"):
        SessionRefused(400, "no", "because")
    assert len(set(REFUSAL_CAUSES)) == len(REFUSAL_CAUSES)
    assert error_body("why", "invalid_request_error", "bad_parameter", "n") == {"error": {
        "message": "why", "type": "invalid_request_error", "param": "n", "code": "bad_parameter"}}
