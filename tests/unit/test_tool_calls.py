"""Tool schemas from type hints and docstrings, argument checks, and the Hermes tool-call parser: malformed JSON,
unknown tools, wrong arguments, several calls in one turn, an unclosed tag."""
from typing import Literal, Optional

import pytest

from asyncrl.generator.agents.tool_calls import HermesToolCallParser, ToolCall
from asyncrl.generator.agents.tool_schema import ToolSchemaError, check_arguments, tool_schema


def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: the first addend
        b (int): the second addend, which may
            span two lines

    Returns:
        a + b
    """
    return a + b


def search(query: str, limit: Optional[int] = None, mode: Literal["fast", "exact"] = "fast",
           tags: list[str] | None = None, weights: list[float] = (), options: dict = None) -> str:
    """Search the notes."""
    return query


def test_the_schema_comes_from_hints_and_the_docstring():
    assert tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers exactly.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "the first addend"},
            "b": {"type": "integer", "description": "the second addend, which may span two lines"}}}}}
    parameters = tool_schema(search, name="notes-search")["function"]["parameters"]
    assert parameters["required"] == ["query"]
    assert parameters["properties"] == {
        "query": {"type": "string"}, "limit": {"type": "integer"},
        "mode": {"type": "string", "enum": ["fast", "exact"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "weights": {"type": "array", "items": {"type": "number"}}, "options": {"type": "object"}}


def test_functions_a_model_cannot_call_are_refused_when_loaded():
    def no_hint(x):
        return x

    def star(*values: int):
        return values

    def odd(x: complex):
        return x

    for fn, message in ((no_hint, "no type hint"), (star, r"\*args"), (odd, "complex")):
        with pytest.raises(ToolSchemaError, match=message):
            tool_schema(fn)
    with pytest.raises(ToolSchemaError, match="letters, digits"):
        tool_schema(add, name="add numbers")


def test_arguments_are_checked_against_the_schema():
    schema = tool_schema(search)
    assert check_arguments(schema, {"query": "x", "limit": 3, "mode": "exact", "tags": ["a"]}) is None
    assert check_arguments(schema, {"query": "x", "limit": None}) is None
    assert "missing required argument(s) query" in check_arguments(schema, {})
    assert "unknown argument(s) lmit" in check_arguments(schema, {"query": "x", "lmit": 3})
    assert "must be integer, got str" in check_arguments(schema, {"query": "x", "limit": "3"})
    assert "must be integer, got bool" in check_arguments(schema, {"query": "x", "limit": True})
    assert "one of ['fast', 'exact']" in check_arguments(schema, {"query": "x", "mode": "slow"})
    assert "item 1 must be string" in check_arguments(schema, {"query": "x", "tags": ["a", 2]})
    assert "JSON object" in check_arguments(schema, ["x"])
    assert check_arguments(tool_schema(add), {"a": 1, "b": 2}) is None


SCHEMAS = {"add": tool_schema(add), "search": tool_schema(search)}


def parse(text):
    return HermesToolCallParser().parse(text, SCHEMAS)


def test_one_call_and_the_text_around_it():
    turn = parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1234, "b": 5678}}\n</tool_call>')
    assert turn.content == "Let me add." and not turn.errors and turn.wants_tools
    assert [(call.name, call.arguments) for call in turn.calls] == [("add", {"a": 1234, "b": 5678})]
    assert isinstance(turn.calls[0], ToolCall) and turn.calls[0].call_id == "call_0"


def test_several_calls_in_one_turn_keep_their_order_and_their_errors():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}</tool_call>'
            "the answer is")
    turn = parse(text)
    assert [(call.name, call.arguments) for call in turn.calls] == [("add", {"a": 1, "b": 2}),
                                                                     ("search", {"query": "q"})]
    assert [error.reason for error in turn.errors] == ["bad_arguments", "unknown_tool", "malformed"]
    assert "missing required argument(s) b" in turn.errors[0].message
    assert "there is no tool 'mul'; the tools are add, search" == turn.errors[1].message
    assert "not valid JSON" in turn.errors[2].message
    assert turn.content == "the answer is"


def test_malformed_calls_never_raise():
    for text in ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}',  # unclosed
                 "<tool_call>[1, 2]</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": 3}</tool_call>', "<tool_call></tool_call>",
                 '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>'):
        turn = parse(text)
        assert not turn.calls and len(turn.errors) == 1 and turn.wants_tools, text
        assert turn.errors[0].reason in ("malformed", "bad_arguments")
    assert not parse("just an answer: 6912").wants_tools
