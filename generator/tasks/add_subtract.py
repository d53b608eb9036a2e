"""Demo task for an agent with two tools: `add:1234+3678=` -> `4912` and `sub:7345-2111=` -> `5234`, answered by
calling the right one of `add(a, b)` and `subtract(a, b)` and copying its result (configs/agent_cpu.yaml).

It is the tool demo's task (add_numbers.py) made to need two tools: the ~1M-parameter model can do neither sum in
its head, and the tool it calls must match the prompt's operation (the other tool's result is wrong). The tools
are not the generator's: the agent (examples/agent/agent.py), written against the official `openai` client,
sends `tools=TOOLS` with every request and runs them itself. Since the chat template renders a request's tools
into the prompt, the SFT transcripts carry exactly these schemas (`tools()`, the `tools` column), so the warm
start has seen the very tool list the agent sends; `tests/unit/test_add_subtract.py` checks the agent's list is
this one.

An episode as the template renders it (the added tokens are single tokens; every other character is one token):

    <|im_start|>system\\ntools: add, subtract<|im_end|>\\n<|im_start|>user\\nsub:7345-2111=<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>{"name":"subtract","arguments":{"a":7345,"b":2111}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n5234<|im_end|>\\n<|im_start|>assistant\\n5234<|im_end|>

What the tool demo found holds here too: every operand and every result has 4 digits (the model copies at fixed
offsets), and the SFT guesses are random numbers, never the result (else the model half learns to compute it and
uses that after a call too). Half the transcripts call the right tool, half guess: headroom for RL.
"""
import json
import random
import string

from asyncrl.generator.tasks.add_numbers import CHAT_TEMPLATE  # noqa: F401 (ChatML with the tool names)
from asyncrl.generator.tasks.exact_match import compute_score  # noqa: F401 (the task's reward)

DATA_SOURCE = "asyncrl/add_subtract"
TOKENIZER_MODEL = "byte_level"
EOS = "<|im_end|>"
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", EOS]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", '"name"', '"arguments"', '"a"', '"b"', "subtract", "add",
                "assistant", "system", "tools", "user"]
"""Ordinary tokens, as a BPE vocabulary would have them: a call is 27 tokens, and the tool's name is one."""
MAX_POSITIONS = 256
"""A tool-using episode is about 75 tokens."""
SFT_TOOL_FRACTION = 0.5
"""Of the SFT transcripts, the fraction that call the right tool; the rest guess an answer."""
OPERATIONS = {"add": ("add", "+"), "sub": ("subtract", "-")}
"""Prompt prefix -> (the tool that answers it, the operator in the prompt)."""


def tools() -> list:
    """The OpenAI schemas of the agent's two tools, exactly as examples/agent/agent.py sends them."""
    def schema(name: str, description: str, a: str, b: str) -> dict:
        properties = {"a": {"type": "integer", "description": a}, "b": {"type": "integer", "description": b}}
        return {"type": "function", "function": {"name": name, "description": description, "parameters": {
            "type": "object", "properties": properties, "required": ["a", "b"]}}}

    return [schema("add", "Add two integers.", "the first addend", "the second addend"),
            schema("subtract", "Subtract b from a.", "the minuend", "the subtrahend")]


def problem(rng) -> tuple[str, int, int, int]:
    """(prompt prefix, a, b, result), every number of 4 digits."""
    if rng.random() < 0.5:
        a, b = rng.randint(1000, 4999), rng.randint(1000, 4999)
        return "add", a, b, a + b
    a = rng.randint(5000, 9999)
    b = rng.randint(1000, a - 1000)
    return "sub", a, b, a - b


def prompt_text(op: str, a: int, b: int) -> str:
    return f"{op}:{a}{OPERATIONS[op][1]}{b}="


def make_rows(num_prompts: int, seed: int) -> list:
    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        op, a, b, result = problem(rng)
        rows.append({"prompt": [{"role": "user", "content": prompt_text(op, a, b)}], "data_source": DATA_SOURCE,
                     "reward_model": {"style": "rule", "ground_truth": str(result)},
                     "extra_info": {"index": index, "split": "train"}})
    return rows


def call_text(name: str, a: int, b: int) -> str:
    """The call in the Hermes format the endpoint parses (`tools.parser: hermes`)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"a": a, "b": b}}, separators=(",", ":")) + \
        "</tool_call>"


def sft_rows(num_rows: int, seed: int, tool_fraction: float = SFT_TOOL_FRACTION) -> list:
    """Chat transcripts with the agent's tool list: a `tool_fraction` of them call the right tool and copy its
    result; the rest answer a random 4-digit number."""
    rng = random.Random(seed)
    schemas = json.dumps(tools())
    rows = []
    for _ in range(num_rows):
        op, a, b, result = problem(rng)
        user = {"role": "user", "content": prompt_text(op, a, b)}
        if rng.random() < tool_fraction:
            messages = [user, {"role": "assistant", "content": call_text(OPERATIONS[op][0], a, b)},
                        {"role": "tool", "content": str(result)}, {"role": "assistant", "content": str(result)}]
        else:
            messages = [user, {"role": "assistant", "content": str(rng.randint(1000, 9999))}]
        rows.append({"messages": messages, "tools": schemas})
    return rows


def tokenizer_corpus(seed: int) -> list:
    """Text with every character the task's conversations use, for the character tokenizer."""
    rows = sft_rows(200, seed, tool_fraction=1.0)
    text = ["tools: add, subtract\n" + "".join(f"{m['role']}\n{m['content']}\n" for m in row["messages"])
            for row in rows]
    return text + [string.printable]  # tool errors and anything else a tool message may say
