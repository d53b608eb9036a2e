"""The built-in `calculator` tool (`tools.builtins=[calculator]`): arithmetic on numbers, evaluated from the
expression's syntax tree, never with `eval`.

The model's text is hostile input, so only numbers, + - * / // % ** and parentheses are accepted, and each
operation is bounded before it runs: a 10,000-digit power or a billion-character expression is refused with a
message, not computed. It runs on the generator's event loop (it is pure and bounded, so a worker process would
cost more than the call), and every refusal becomes the tool message the model reads.
"""
import ast
import math
import operator
import re

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 60  # of any integer operand or result
MAX_EXPONENT = 64
LEADING_ZEROS = re.compile(r"(?<![\d.\w])0+(?=\d)")
"""`0317` is 317 on a calculator, though not in Python's syntax."""

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message tells the model why."""


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "1234+5678" or "(3+4)*2"
    """
    return format_number(evaluate(expression))


def evaluate(expression: str):
    """The expression's value (int or float), or CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(LEADING_ZEROS.sub("", expression.strip()), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"{expression!r} is not an arithmetic expression") from None
    return _value(tree.body)


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or (right < 0 and left == 0)):
            raise CalculatorError(f"exponents are limited to {MAX_EXPONENT} in magnitude (and 0 has no negative power)")
        try:
            return _checked(OPERATORS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed")


def _checked(value):
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
        raise CalculatorError(f"numbers are limited to {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def format_number(value) -> str:
    """Integers exactly; floats to 12 significant digits, integral ones without a fraction (7/7 -> "1")."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)
