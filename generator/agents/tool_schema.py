"""A plain Python function as an OpenAI function-calling tool: its schema from its type hints and docstring, and a
check of the arguments a model wrote against that schema.

The schema is what the chat template shows the model (`tools=[...]`), in the OpenAI format:
`{"type": "function", "function": {"name", "description", "parameters": <JSON Schema object>}}`. The description is
the docstring's text before its `Args:` section; each parameter's description comes from that section
(Google style, `name: text` or `name (type): text`). Supported hints: str, int, float, bool, list[X], dict,
Optional[X] / X | None (not required), Literal[...] (an enum); a parameter with a default is not required. A
hint outside that set is refused when the tool is loaded, not when a model first calls it.

`check_arguments` is the model-facing half: a call with a missing, unknown or mistyped argument gets a message
the model can read and correct, never an exception in the generator.
"""
import inspect
import re
import types
import typing

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


class ToolSchemaError(ValueError):
    """The function cannot be described as a tool (an unsupported type hint, *args, a missing hint)."""


def tool_schema(fn, name: str | None = None) -> dict:
    """The OpenAI tool schema of `fn` (named `name`, default the function's name)."""
    name = name or fn.__name__
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ToolSchemaError(f"tool name {name!r} must be 1-64 letters, digits, '_' or '-' (OpenAI's rule)")
    description, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolSchemaError(f"tool {name}: *args and **kwargs cannot be described to a model")
        if param.name not in hints:
            raise ToolSchemaError(f"tool {name}: parameter {param.name!r} has no type hint")
        schema, optional = json_schema_of(hints[param.name], f"tool {name}, parameter {param.name!r}")
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is param.empty and not optional:
            required.append(param.name)
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def json_schema_of(hint, where: str) -> tuple[dict, bool]:
    """(JSON Schema of the hint, whether None is allowed)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        others = [arg for arg in args if arg is not type(None)]
        if len(others) != 1 or len(others) == len(args):
            raise ToolSchemaError(f"{where}: only Optional[X] unions are supported, got {hint}")
        return json_schema_of(others[0], where)[0], True
    if origin is typing.Literal:
        kinds = {type(arg) for arg in args}
        if len(kinds) != 1 or kinds - {str, int}:
            raise ToolSchemaError(f"{where}: Literal values must all be str or all int, got {hint}")
        return {"type": JSON_TYPES[kinds.pop()], "enum": list(args)}, False
    if origin is list:
        items = json_schema_of(args[0], where)[0] if args else {}
        return {"type": "array", **({"items": items} if items else {})}, False
    if origin is dict or hint is dict:
        return {"type": "object"}, False
    if hint in JSON_TYPES:
        return {"type": JSON_TYPES[hint]}, False
    raise ToolSchemaError(f"{where}: type {hint} has no JSON Schema here (use str, int, float, bool, list, dict, "
                          f"Optional or Literal)")


def parse_docstring(doc: str) -> tuple[str, dict]:
    """(the text before `Args:`, {parameter: its description}) of a Google-style docstring."""
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:", "Parameters:")]
    if not starts:
        return doc.strip(), {}
    head, arg_docs, current = "\n".join(lines[:starts[0]]).strip(), {}, None
    for line in lines[starts[0] + 1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next section (Returns:, Raises:) or text after the list
        match = re.match(r"\s+(\w+)\s*(\([^)]*\))?\s*:\s*(.*)", line)
        if match:
            current = match.group(1)
            arg_docs[current] = match.group(3).strip()
        elif current and line.strip():
            arg_docs[current] = f"{arg_docs[current]} {line.strip()}"
    return head, arg_docs


def check_arguments(schema: dict, arguments) -> str | None:
    """None if `arguments` fits the tool's parameters, else what is wrong, in words for the model."""
    parameters = schema["function"]["parameters"]
    properties, required = parameters.get("properties", {}), parameters.get("required", [])
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    unknown = sorted(set(arguments) - set(properties))
    if unknown and parameters.get("additionalProperties", False) is False:
        return f"unknown argument(s) {', '.join(unknown)}; expected {', '.join(properties) or 'none'}"
    missing = [name for name in required if name not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    for name, value in arguments.items():
        problem = value_problem(properties.get(name, {}), value)
        if problem:
            return f"argument {name!r}: {problem}"
    return None


def value_problem(schema: dict, value) -> str | None:
    if value is None:
        return None  # Optional parameters accept null; a required one given null is its function's business
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']}, got {value!r}"
    kind = schema.get("type")
    fits = {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }.get(kind, True)
    if not fits:
        return f"must be {kind}, got {type(value).__name__} {value!r}"[:200]
    if kind == "array" and "items" in schema:
        for index, item in enumerate(value):
            problem = value_problem(schema["items"], item)
            if problem:
                return f"item {index} {problem}"
    return None
