"""Demo task for tools: add two 4-digit numbers (`add:1234+3678=` -> `4912`) with the built-in `calculator`.

The demo's ~1M-parameter model cannot add 4-digit numbers in its head, but it can learn to call the calculator
and copy the result into its answer. The SFT warm start shows both habits: half the transcripts call the tool and
copy its result, the others guess a number; asynchronous RL then raises the reward by raising the fraction of
episodes that call the tool and copy right (configs/tools_cpu.yaml, docs/benchmarks.md "The tool demo").

A tool-using episode, as the chat template below renders it (the added tokens are single tokens of the demo
tokenizer; every other character is one token):

    <|im_start|>system\\ntools: calculator<|im_end|>\\n<|im_start|>user\\nadd:1234+3678=<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>{"name":"calculator","arguments":{"expression":"1234+3678"}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n4912<|im_end|>\\n<|im_start|>assistant\\n4912<|im_end|>

What the measured recipe depends on: the operands are at most 4999, so every result has 4 digits and the model
copies at fixed offsets (with 4- and 5-digit results mixed it learned one offset and copied half of the answers
wrong); the guesses are random, not the sum, which the model would otherwise half learn and use after a call too.

Rows follow verl's format, as the sort task's do; the SFT rows are chat transcripts (`messages`, and `tools`
as JSON: data/sft.py renders them with the same template and tool list as the generator).
"""
import json
import random
import string

from asyncrl.generator.agents.calculator import calculator
from asyncrl.generator.agents.tool_schema import tool_schema
from asyncrl.generator.tasks.exact_match import compute_score  # noqa: F401 (the task's reward)

DATA_SOURCE = "asyncrl/add_numbers"
TOKENIZER_MODEL = "byte_level"  # whitespace and JSON survive Qwen2Tokenizer (launch/demo.py)
EOS = "<|im_end|>"
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", EOS]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", '"name"', '"arguments"', '"expression"', "calculator", "assistant",
                "system", "tools", "user"]
"""Ordinary (non-special) tokens: they survive decoding, where the tool-call parser finds them. The words are
single tokens as a BPE vocabulary would have them: a call is 27 tokens instead of 62, which halves the distance
over which the model copies the operands into it."""
MAX_POSITIONS = 256
"""A tool-using episode is about 80 tokens."""
SFT_TOOL_FRACTION = 0.5
"""Of the SFT transcripts, the fraction that call the calculator; the rest guess an answer."""
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function.name') | join(', ') }}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with the tool names (not their schemas: the model learns the call format in SFT, and a 200-character
schema in every prompt would double the learner's work)."""


def _pair(rng) -> tuple[int, int]:
    """Operands whose sum has 4 digits too: the tool's result, and so the answer, always has the same length."""
    return rng.randint(1000, 4999), rng.randint(1000, 4999)


def make_rows(num_prompts: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        a, b = _pair(rng)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"add:{a}+{b}="}],
                "data_source": DATA_SOURCE,
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": index, "split": "train"},
            }
        )
    return rows


def tools() -> list[dict]:
    """The OpenAI schemas of the demo's tools, as the generator offers them (`tools.builtins=[calculator]`)."""
    return [tool_schema(calculator)]


def call_text(expression: str) -> str:
    arguments = {"name": "calculator", "arguments": {"expression": expression}}
    return "<tool_call>" + json.dumps(arguments, separators=(",", ":")) + "</tool_call>"


def sft_rows(num_rows: int, seed: int, tool_fraction: float = SFT_TOOL_FRACTION) -> list[dict]:
    """Chat transcripts: a `tool_fraction` of them call the calculator, then copy its result; the rest answer
    directly."""
    rng = random.Random(seed)
    schemas = json.dumps(tools())
    rows = []
    for _ in range(num_rows):
        a, b = _pair(rng)
        user = {"role": "user", "content": f"add:{a}+{b}="}
        if rng.random() < tool_fraction:
            messages = [user, {"role": "assistant", "content": call_text(f"{a}+{b}")},
                        {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]
        else:  # a guess: were it the sum, the model would learn half an adder that it then uses after a call too
            messages = [user, {"role": "assistant", "content": str(rng.randint(2000, 9998))}]
        rows.append({"messages": messages, "tools": schemas})
    return rows


def tokenizer_corpus(seed: int) -> list[str]:
    """Text with every character the task's conversations use, for the character tokenizer."""
    rows = sft_rows(200, seed, tool_fraction=1.0)
    text = ["tools: calculator\n" + "".join(f"{m['role']}\n{m['content']}\n" for m in row["messages"]) for row in rows]
    return text + [string.printable]  # tool errors and anything else a tool message may say
