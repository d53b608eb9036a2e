"""An agent written against Anthropic's Messages API (the official `anthropic` client), unmodified, as asyncrl's
`agent.path`.

Its second parameter is named `anthropic_client`, so asyncrl hands it an `anthropic.AsyncAnthropic` client pointed
at the episode's endpoint (`POST /v1/messages`; the key names the episode) instead of an OpenAI one. The loop is the
tool-use loop of Anthropic's docs: call the model with the tools, send its reply's content back as the assistant
turn, answer each `tool_use` block with a `tool_result` block, until a reply uses no tool.

    asyncrl run --config tools_cpu.yaml tools.builtins=[] agent.path=examples/anthropic_client/agent.py

(tools_cpu.yaml's model was warm-started to call `calculator` on `add:1234+3678=`; docs/agents.md "The Anthropic
Messages endpoint".)
"""
from asyncrl.generator.agents.calculator import evaluate, format_number

MAX_TURNS = 3
"""Model turns per episode; the recipe's rollout.max_turns should be at least this."""

TOOLS = [
    {"name": "calculator", "description": "Evaluate an arithmetic expression.",
     "input_schema": {"type": "object", "required": ["expression"], "properties": {"expression": {
         "type": "string", "description": "numbers with + - * / and parentheses, e.g. 1234+3678."}}}},
    {"name": "digit_count", "description": "Count the decimal digits of an integer.",
     "input_schema": {"type": "object", "required": ["number"], "properties": {"number": {
         "type": "integer", "description": "the integer."}}}},
]


def run_tool(name: str, arguments: dict) -> tuple[str, bool]:
    """(the result's text, whether it is an error) of one tool_use block."""
    try:
        if name == "calculator":
            return format_number(evaluate(arguments["expression"])), False  # asyncrl's bounded evaluator
        return str(len(str(abs(int(arguments["number"]))))), False
    except (KeyError, TypeError, ValueError, ArithmeticError) as err:
        return f"{type(err).__name__}: {err}", True


async def episode(row, anthropic_client):
    """One episode: the tool-use loop over the task's prompt; 1.0 when the last reply is the right answer."""
    messages = list(row["prompt"])
    for _ in range(MAX_TURNS):
        reply = await anthropic_client.messages.create(model="asyncrl", max_tokens=256, messages=messages,
                                                       tools=TOOLS)
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            text = "".join(block.text for block in reply.content if block.type == "text")
            return float(text.strip() == row["ground_truth"])
        results = []
        for block in reply.content:
            if block.type == "tool_use":
                output, failed = run_tool(block.name, block.input)
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": output,
                                "is_error": failed})
        messages.append({"role": "user", "content": results})
    return 0.0  # the model kept calling tools: no answer
