"""The tool demo's task (generator/tasks/add_numbers.py): the properties its measured recipe depends on."""
import asyncio
import json

from asyncrl.generator.agents.calculator import calculator
from asyncrl.generator.tasks import add_numbers
from asyncrl.launch.demo import train_char_tokenizer


def test_every_sum_has_four_digits_so_the_answer_is_copied_at_fixed_offsets():
    for row in add_numbers.make_rows(2000, seed=0):
        a, b = row["prompt"][0]["content"][len("add:"):-1].split("+")
        assert len(a) == len(b) == 4
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))
        assert len(row["reward_model"]["ground_truth"]) == 4


def test_sft_transcripts_call_the_calculator_and_copy_its_result_or_guess():
    rows = add_numbers.sft_rows(400, seed=1)
    calls = [row for row in rows if len(row["messages"]) == 4]
    assert 150 < len(calls) < 250  # SFT_TOOL_FRACTION = 0.5
    for row in calls:
        user, call, tool, answer = row["messages"]
        expression = user["content"][len("add:"):-1]
        body = json.loads(call["content"][len("<tool_call>"):-len("</tool_call>")])
        assert body == {"name": "calculator", "arguments": {"expression": expression}}
        assert tool["content"] == asyncio.run(calculator(expression)) == answer["content"]
    guesses = [row for row in rows if len(row["messages"]) == 2]
    right = sum(row["messages"][1]["content"] == str(sum(map(int, row["messages"][0]["content"][4:-1].split("+"))))
                for row in guesses)
    assert right <= 2  # guesses, not the sum: the model is not taught half an adder


def test_a_call_is_short_in_the_demo_tokenizer():
    tokenizer = train_char_tokenizer(add_numbers, add_numbers.tokenizer_corpus(0))
    text = add_numbers.call_text("1234+3678")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) == 27  # the words are single tokens: 62 with characters alone
