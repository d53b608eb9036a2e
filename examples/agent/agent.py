"""An agent written against the official `openai` client, as a user writes one: a plain chat-completions loop that
offers two tools, runs the ones the model calls, and scores the final answer. asyncrl runs it as `agent.path`,
handing it an `openai.AsyncOpenAI` client pointed at the generator's endpoint (docs/agents.md).

    asyncrl run --config agent_cpu.yaml            # from the repository root (agent.path is relative to it)

The task (generator/tasks/add_subtract.py): `add:1234+3678=` or `sub:7345-2111=`, answered with the 4-digit
result. The model cannot compute it; it must call `add` or `subtract`, whichever the prompt asks for, and copy
the result. The model's warm start was trained on transcripts rendered with exactly TOOLS (the chat template
writes a request's tools into the prompt), so what this agent sends is what the model has seen.
"""
import json

MAX_TURNS = 3
"""Chat requests per episode: call, answer, one spare; the recipe's rollout.max_turns is the same."""

TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the first addend"},
            "b": {"type": "integer", "description": "the second addend"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "subtract", "description": "Subtract b from a.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the minuend"},
            "b": {"type": "integer", "description": "the subtrahend"}}, "required": ["a", "b"]}}},
]
FUNCTIONS = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b}


def run_tool(call) -> dict:
    """The tool message answering one call; a call with bad arguments gets an error the model can read."""
    try:
        arguments = json.loads(call.function.arguments)
        a, b = arguments["a"], arguments["b"]
        if not (isinstance(a, int) and isinstance(b, int)):
            raise TypeError("a and b must be integers")
        content = str(FUNCTIONS[call.function.name](a, b))
    except (ValueError, KeyError, TypeError) as err:
        content = f"error: {type(err).__name__}: {err}"
    return {"role": "tool", "tool_call_id": call.id, "content": content}


async def episode(row, client):
    """One episode; its reward is 1.0 when the final answer is the ground truth, else 0.0."""
    messages = list(row["prompt"])
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="asyncrl", messages=messages, tools=TOOLS)
        choice = response.choices[0]
        if choice.finish_reason == "length":  # cut by max_tokens: no answer, and no turn may follow it
            return 0.0
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls:  # the answer (or a malformed call, which is a wrong answer)
            return float((choice.message.content or "").strip() == row["ground_truth"])
        messages += [run_tool(call) for call in choice.message.tool_calls]
    return 0.0  # kept calling tools: no answer
