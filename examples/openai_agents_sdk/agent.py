"""An agent written with the OpenAI Agents SDK (`openai-agents`), unmodified, as asyncrl's `agent.path`.

The SDK is pointed at the episode's endpoint with the client asyncrl hands the function (its base URL is the
generator's OpenAI-compatible endpoint, its API key names the episode): `OpenAIChatCompletionsModel` over that
client. The SDK sends the whole history back on each turn (the endpoint checks it against what it sampled) and
runs the function tools itself. Tracing is off: it would upload spans to OpenAI.

    asyncrl run --config tools_cpu.yaml tools.builtins=[] agent.path=examples/openai_agents_sdk/agent.py

(tools_cpu.yaml's model was warm-started to call `calculator` on `add:1234+3678=`; docs/agents.md "Harnesses".)
"""
from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from asyncrl.generator.agents.calculator import evaluate, format_number

set_tracing_disabled(True)

MAX_TURNS = 3
"""Model turns per episode; the recipe's rollout.max_turns should be at least this."""


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. 1234+3678.
    """
    return format_number(evaluate(expression))  # asyncrl's bounded evaluator: no eval()


@function_tool
def digit_count(number: int) -> int:
    """Count the decimal digits of an integer.

    Args:
        number: the integer.
    """
    return len(str(abs(number)))


async def episode(row, client):
    """One episode: the SDK's agent loop over the task's prompt; 1.0 when its final answer is right."""
    agent = Agent(name="adder", tools=[calculator, digit_count],
                  model=OpenAIChatCompletionsModel(model="asyncrl", openai_client=client))
    try:
        result = await Runner.run(agent, list(row["prompt"]), max_turns=MAX_TURNS)
    except MaxTurnsExceeded:  # the model kept calling tools: no answer
        return 0.0
    return float(str(result.final_output).strip() == row["ground_truth"])
