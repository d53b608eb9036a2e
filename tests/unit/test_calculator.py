"""The built-in calculator tool: what it evaluates, and that hostile expressions are refused, never run."""
import asyncio

import pytest

from asyncrl.generator.agents.calculator import CalculatorError, calculator, evaluate, format_number
from asyncrl.generator.agents.tool_schema import tool_schema


@pytest.mark.parametrize("expression, expected", [
    ("1234+5678", "6912"), ("(3+4)*2", "14"), ("7/7", "1"), ("1/3", "0.333333333333"), ("-2**3", "-8"),
    ("17//5", "3"), ("17%5", "2"), ("0317+0001", "318"), ("1.05*2", "2.1"), (" 2 - 10 ", "-8"), ("1e3+1", "1001"),
])
def test_arithmetic(expression, expected):
    assert asyncio.run(calculator(expression)) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers"), ("x+1", "only numbers"), ("1/0", "division by zero"),
    ("9**9**9", "exponents are limited"), ("10**60*10**60", "limited to 60 digits"), ("1+", "not an arithmetic"),
    ("(-8)**0.5", "not a real number"), ("1.0e308*10", "not a finite number"), ("1" * 300, "at most 200"),
    ("True+1", "only numbers"), ("[1][0]", "only numbers"), ("0**-1", "no negative power"),
])
def test_refusals(expression, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_not_a_string_is_refused():
    with pytest.raises(CalculatorError, match="must be a string"):
        evaluate(12)


def test_format_number():
    assert format_number(10 ** 20) == "100000000000000000000" and format_number(2.5) == "2.5"
    assert format_number(1e20) == "1e+20"


def test_schema_the_model_sees():
    schema = tool_schema(calculator)["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert "1234+5678" in schema["parameters"]["properties"]["expression"]["description"]


def test_in_the_tool_box_a_refusal_is_the_tool_message():
    from asyncrl.generator.agents.tool_calls import ToolCall
    from asyncrl.generator.agents.tools import ToolBox

    box = ToolBox([], workers=1, timeout_s=5.0, max_output_chars=200, builtins=[calculator])
    assert box.pool is None  # pure and bounded: it runs on the event loop, not in a worker process
    ok = asyncio.run(box.call(ToolCall("calculator", {"expression": "2+2"})))
    bad = asyncio.run(box.call(ToolCall("calculator", {"expression": "open('x')"})))
    assert (ok.text, ok.error) == ("4", None)
    assert bad.error == "error" and "only numbers" in bad.text
    assert box.metrics()["rollout/tool_errors/error"] == 1.0 and "timing/tool/calculator_s" in box.metrics()


def test_the_recipe_names_it():
    from asyncrl.generator.config import ToolsConfig

    assert ToolsConfig(builtins=["calculator"]).offered()
    with pytest.raises(ValueError, match="the built-in tools are"):
        ToolsConfig(builtins=["abacus"])
