"""Finding the tool calls in what a model wrote. The parser is pluggable (`tools.parser`); the default is the
Qwen/Hermes format the Qwen2 chat template teaches:

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

A turn may hold several calls. Each one the model got wrong becomes a `ToolCallError` with a reason
(`malformed`: not JSON, no name, an unclosed tag; `unknown_tool`; `bad_arguments`) and a message that is sent back
to the model as that call's result, so it can correct itself; none of them raises. Parsing works on the decoded
text of the model's turn only to find the calls: the tokens the model wrote stay as they were sampled.
"""
import json
import re
from dataclasses import dataclass, field

from asyncrl.generator.agents.tool_schema import check_arguments


@dataclass
class ToolCall:
    name: str
    arguments: dict
    call_id: str = ""


@dataclass
class ToolCallError:
    reason: str  # malformed, unknown_tool, bad_arguments
    message: str  # what the model is told
    name: str = ""


@dataclass
class ParsedTurn:
    content: str  # the text outside the calls
    items: list = field(default_factory=list)  # ToolCall or ToolCallError, in the order written

    @property
    def calls(self) -> list:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def errors(self) -> list:
        return [item for item in self.items if isinstance(item, ToolCallError)]

    @property
    def wants_tools(self) -> bool:
        """The model asked for at least one tool (correctly or not): the episode goes on with their results."""
        return bool(self.items)


class HermesToolCallParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn."""

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str, schemas: dict) -> ParsedTurn:
        """`schemas`: tool name -> its OpenAI schema (generator/agents/tool_schema.py)."""
        turn = ParsedTurn(content="")
        pattern = re.compile(re.escape(self.open_tag) + r"(.*?)(" + re.escape(self.close_tag) + r"|$)", re.DOTALL)
        position = 0
        for index, match in enumerate(pattern.finditer(text)):
            turn.content += text[position:match.start()]
            position = match.end()
            if not match.group(2):
                turn.items.append(ToolCallError("malformed", f"the tool call has no closing {self.close_tag}"))
                continue
            outcome = read_call(match.group(1), schemas)
            if isinstance(outcome, ToolCall):
                outcome.call_id = f"call_{index}"
            turn.items.append(outcome)
        turn.content = (turn.content + text[position:]).strip()
        return turn


def read_call(body: str, schemas: dict):
    """One call's JSON body to a ToolCall, or the ToolCallError that says what is wrong with it."""
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as err:
        return ToolCallError("malformed", f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError("malformed", 'a tool call must be {"name": <tool>, "arguments": {...}}')
    name, arguments = obj["name"], obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as the OpenAI API does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCallError("bad_arguments", f"the arguments of {name} are not a JSON object", name)
    if name not in schemas:
        return ToolCallError("unknown_tool", f"there is no tool {name!r}; the tools are {', '.join(sorted(schemas))}",
                             name)
    problem = check_arguments(schemas[name], arguments)
    if problem:
        return ToolCallError("bad_arguments", f"{name}: {problem}", name)
    return ToolCall(name, arguments)


TOOL_CALL_PARSERS = {"hermes": HermesToolCallParser}
