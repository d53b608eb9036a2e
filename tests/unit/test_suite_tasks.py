"""The suite's own tasks (bench/suite/): their data writers keep the held-out split out of training and write what
the task says, and their reward files give exact answers 1.0, partial credit where the task has it, and garbage 0."""
import json

import pytest

from asyncrl.bench.suite import digit_words, sort_letters, spell_backward
from asyncrl.bench.suite.assets import check_held_out, prompt_text
from asyncrl.bench.suite.rewards import digit_words as digit_words_reward
from asyncrl.bench.suite.rewards import sort_letters as sort_letters_reward
from asyncrl.bench.suite.rewards import spell_backward as spell_backward_reward

GARBAGE = ["", "   ", "<|im_end|>", "\x00\ufffd" * 50, "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz", None]


@pytest.mark.parametrize("module", [digit_words, sort_letters, spell_backward])
def test_splits_are_seeded_sized_and_hold_the_test_prompts_out(module):
    splits = module.make_splits(num_train=64, num_sft=32, num_test=16, seed=3)
    assert {split: len(rows) for split, rows in splits.items()} == {"train": 64, "sft": 32, "test": 16}
    check_held_out(splits)  # raises on a leak
    prompts = [prompt_text(row) for rows in splits.values() for row in rows]
    assert len(set(prompts)) == len(prompts)
    assert module.make_splits(64, 32, 16, 3) == splits
    assert module.make_splits(64, 32, 16, 4)["test"] != splits["test"]
    assert {row["data_source"] for rows in splits.values() for row in rows} == {module.NAME}


def test_a_leaked_test_prompt_is_refused():
    splits = sort_letters.make_splits(8, 8, 4, seed=0)
    splits["sft"].append(splits["test"][0])
    with pytest.raises(ValueError, match="held-out prompts are also in train/sft"):
        check_held_out(splits)


def test_digit_words_answers_are_long_and_all_or_nothing():
    rows = digit_words.make_splits(256, 8, 8, seed=0)["train"]
    lengths = [len(row["reward_model"]["ground_truth"]) for row in rows]
    assert min(lengths) >= 11 and max(lengths) <= 29 and sum(12 <= n <= 24 for n in lengths) > 0.7 * len(rows)
    assert rows[0]["reward_model"]["ground_truth"] == digit_words.spell(rows[0]["prompt"][0]["content"][4:-1])
    score = digit_words_reward.compute_score
    assert score("digit_words", "four zero seven", "four zero seven") == 1.0
    assert score("digit_words", " four  zero seven\n", "four zero seven") == 1.0
    assert score("digit_words", "four zero six", "four zero seven") == 0.0
    assert all(score("digit_words", bad, "four zero seven") == 0.0 for bad in GARBAGE)


def test_sort_letters_gives_partial_credit_and_one_only_when_exact():
    row = sort_letters.make_splits(4, 4, 4, seed=0)["test"][0]
    letters = row["prompt"][0]["content"][len("sort:"):-1]
    assert row["reward_model"]["ground_truth"] == "".join(sorted(letters))
    score = sort_letters_reward.compute_score
    assert score("sort_letters", "abqxz", "abqxz") == 1.0
    assert score("sort_letters", "abqxy", "abqxz") == pytest.approx(0.8)
    assert score("sort_letters", "abqxzz", "abqxz") == pytest.approx(5 / 6)  # too long: not exact
    assert score("sort_letters", "abq", "abqxz") == pytest.approx(0.6)
    assert all(score("sort_letters", bad, "abqxz") < 0.25 for bad in GARBAGE)


def test_spell_backward_is_scored_by_reasoning_gyms_verifier_on_the_rows_entry():
    row = spell_backward.make_splits(4, 4, 4, seed=0)["test"][0]
    entry = json.loads(row["extra_info"]["entry"])
    word, truth = entry["metadata"]["word"], row["reward_model"]["ground_truth"]
    assert row["prompt"][0]["content"] == f"spell:{word}=" and truth == word[::-1] == entry["answer"]
    assert spell_backward.MIN_WORD_LEN <= len(word) <= spell_backward.MAX_WORD_LEN
    score = spell_backward_reward.compute_score
    assert score("spell_backward", truth, truth, row["extra_info"]) == 1.0
    assert score("spell_backward", f" {truth.upper()}\n", truth, row["extra_info"]) == 1.0  # the verifier's casefold
    partial = score("spell_backward", truth[:-1] + "#", truth, row["extra_info"])
    assert 0.0 < partial < 1.0
    assert all(score("spell_backward", bad, truth, row["extra_info"]) < 0.5 for bad in GARBAGE)
    assert score("spell_backward", truth, truth, None) == 1.0  # no entry: the verifier still has the answer


def test_the_suite_holds_the_two_demos_first_and_three_untuned_tasks():
    from asyncrl.bench.suite.tasks import SUITE, build_task

    assert list(SUITE) == ["sort", "tools", "digit_words", "sort_letters", "spell_backward"]
    with pytest.raises(ValueError, match="no suite task 'nope'"):
        build_task("nope", "/nonexistent")
