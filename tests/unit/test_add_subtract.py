"""The agent recipe's task (generator/tasks/add_subtract.py) and its agent (examples/agent/agent.py): the properties
the measured recipe depends on, and that the warm start's tool list is the one the agent sends."""
import json
import os
from types import SimpleNamespace

from asyncrl.generator.agents.chat_render import ChatAppender
from asyncrl.generator.agents.openai_agent import load_agent_function
from asyncrl.generator.tasks import add_subtract
from asyncrl.generator.user_code.loader import load_from_file
from asyncrl.launch.demo import train_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(ROOT, "examples", "agent", "agent.py")


def operands(prompt: str) -> tuple:
    op, expression = prompt[:-1].split(":")
    a, b = expression.split(add_subtract.OPERATIONS[op][1])
    return op, a, b


def test_both_operations_come_up_and_every_number_has_four_digits():
    rows = add_subtract.make_rows(2000, seed=0)
    ops = [operands(row["prompt"][0]["content"])[0] for row in rows]
    assert 900 < ops.count("add") < 1100 and ops.count("add") + ops.count("sub") == 2000
    for row in rows:
        op, a, b = operands(row["prompt"][0]["content"])
        truth = row["reward_model"]["ground_truth"]
        assert len(a) == len(b) == len(truth) == 4
        assert int(truth) == (int(a) + int(b) if op == "add" else int(a) - int(b))


def test_sft_transcripts_call_the_right_tool_and_copy_its_result_or_guess():
    rows = add_subtract.sft_rows(400, seed=1)
    calls = [row for row in rows if len(row["messages"]) == 4]
    assert 150 < len(calls) < 250  # SFT_TOOL_FRACTION = 0.5
    agent_tools = load_from_file(AGENT, "FUNCTIONS", "agent.path")
    for row in calls:
        user, call, tool, answer = row["messages"]
        op, a, b = operands(user["content"])
        body = json.loads(call["content"][len("<tool_call>"):-len("</tool_call>")])
        assert body == {"name": add_subtract.OPERATIONS[op][0], "arguments": {"a": int(a), "b": int(b)}}
        assert tool["content"] == str(agent_tools[body["name"]](int(a), int(b))) == answer["content"]
    guesses = [row["messages"] for row in rows if len(row["messages"]) == 2]
    assert sum(len(m[1]["content"]) == 4 for m in guesses) == len(guesses)


def test_the_warm_start_renders_exactly_the_tools_the_agent_sends():
    """The chat template writes a request's tools into the prompt: a warm start on another list would teach the
    model a prompt the agent never sends (issue 42: two tools offered to a model warm-started on one)."""
    agent_tools = load_from_file(AGENT, "TOOLS", "agent.path")
    assert agent_tools == add_subtract.tools()
    for row in add_subtract.sft_rows(20, seed=2):
        assert json.loads(row["tools"]) == agent_tools
    tokenizer = train_char_tokenizer(add_subtract, add_subtract.tokenizer_corpus(0))
    opening = ChatAppender(tokenizer, tools=agent_tools).prompt_ids([{"role": "user", "content": "add:1234+3678="}])
    assert tokenizer.decode(opening).startswith("<|im_start|>system\ntools: add, subtract<|im_end|>\n")


def test_a_call_round_trips_the_demo_tokenizer_in_27_tokens():
    tokenizer = train_char_tokenizer(add_subtract, add_subtract.tokenizer_corpus(0))
    for name in ("add", "subtract"):
        text = add_subtract.call_text(name, 7345, 2111)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text and len(ids) == 27


def test_the_agent_runs_the_tools_and_answers_bad_arguments_with_an_error():
    run_tool = load_from_file(AGENT, "run_tool", "agent.path")
    assert load_agent_function(AGENT, "episode") is not None

    def call(name, arguments):
        return SimpleNamespace(id="c1", function=SimpleNamespace(name=name, arguments=arguments))

    assert run_tool(call("subtract", '{"a": 7345, "b": 2111}')) == {"role": "tool", "tool_call_id": "c1",
                                                                     "content": "5234"}
    assert run_tool(call("add", '{"a": "12", "b": 1}'))["content"].startswith("error: TypeError")
    assert run_tool(call("add", '{"a": 1}'))["content"].startswith("error: KeyError")
    assert run_tool(call("add", "not json"))["content"].startswith("error: JSONDecodeError")
