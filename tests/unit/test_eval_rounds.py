"""Evaluation rounds on the fleet (buffer/eval_rounds.py) and the generator's side of them: pinned to a version,
dealt beside the admissions, checked when they come back, abandoned when late."""
import asyncio

import pytest

from asyncrl.buffer.eval_rounds import (EVAL_TEXT_CHARS_PER_TOKEN, EVAL_TEXT_KEPT_CHARS, EvalRounds, check_result,
                                        eval_due, first_due)
from asyncrl.buffer.interface import AdmitReply, EvalTask, Status
from asyncrl.buffer.plausibility import reward_problem
from asyncrl.configs import load_config, training_eval_blocker
from asyncrl.data.prompts import PromptRow, encode_prompt, encode_prompts
from asyncrl.generator.admission import AdmissionGate


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def rounds(count=3, clock=None):
    rows = [PromptRow(f"t:{i}", [3, 4], "a" if i % 2 else "b", None, {}) for i in range(count)]
    return EvalRounds(encode_prompts(rows), timeout_s=60.0, clock=clock or Clock())


def test_a_round_is_dealt_only_to_generators_at_or_behind_its_version_and_finishes_in_order():
    evals = rounds(3)
    evals.open(4, n=2, temperature=0.0, max_tokens=8)
    assert evals.deal("ahead", 5, 8) == [] and evals.deal("unknown", None, 8) == []
    first = evals.deal("g1", 4, 2)
    second = evals.deal("g2", 3, 2)
    assert [d[1] for d in first + second] == [4, 4, 4] and evals.deal("g3", 0, 2) == []
    for holder, deal in [("g1", first[0]), ("g1", first[1]), ("g2", second[0])]:
        assert evals.result(holder, deal[0], [1.0, 0.0], [3, 8]) is None
    (done,) = evals.finished()
    assert done.version == 4 and [r[0] for r in done.results] == ["b", "a", "b"]
    assert done.results[1] == ("a", [1.0, 0.0], [3, 8]) and evals.open_versions() == []


def test_results_are_checked_and_a_bad_or_foreign_one_goes_back_to_the_round():
    evals = rounds(1)
    evals.open(0, n=2, temperature=1.0, max_tokens=8)
    (deal,) = evals.deal("g1", 0, 1)
    assert "not out to 'g2'" in evals.result("g2", deal[0], [1.0, 1.0], [1, 1])
    assert "finite" in evals.result("g1", deal[0], [float("nan"), 1.0], [1, 1])
    (again,) = evals.deal("g2", 0, 1)  # the refused prompt went back
    assert evals.result("g2", again[0], None, None) is None  # given back: it could not pin v0
    (third,) = evals.deal("g1", 0, 1)
    assert evals.forget("g1") == 1 and len(evals.deal("g3", 0, 1)) == 1
    for bad in [([1.0], [1]), ([1.0, 1.0], [1, 9]), ([True, 1.0], [1, 1]), ([1.0, 1.0], [1.5, 1]), ("x", [1, 1])]:
        assert check_result(*bad, n=2, max_tokens=8) is not None
    assert evals.refused == 2


def test_the_completions_text_of_a_result_is_checked_like_the_rest():
    """A generator's texts (for the learner's samples table) are n strings, none longer than the round's max_tokens
    could decode to; anything else refuses the whole result, and the prompt goes back to its round."""
    longest = EVAL_TEXT_CHARS_PER_TOKEN * 8
    assert check_result([1.0, 0.0], [1, 1], 2, 8, ["a" * longest, ""]) is None
    for texts in (["a"], ["a", 1], "ab", ["a", "b", "c"], ["a" * (longest + 1), "b"], {"a": 1}):
        assert check_result([1.0, 0.0], [1, 1], 2, 8, texts) is not None, texts
    evals = rounds(1)
    evals.open(0, n=2, temperature=1.0, max_tokens=100)
    (deal,) = evals.deal("g1", 0, 1)
    assert "2 strings" in evals.result("g1", deal[0], [1.0, 0.0], [1, 1], [b"raw", "x"])
    (again,) = evals.deal("g2", 0, 1)
    plausible = "x" * (EVAL_TEXT_CHARS_PER_TOKEN * 100)  # 3200 characters from 100 tokens: accepted
    assert evals.result("g2", again[0], [1.0, 0.0], [1, 1], ["ok", plausible]) is None
    (done,) = evals.finished()  # what the table shows is kept, no more: a round's memory is bounded
    assert done.samples == [(evals.blobs[0], ["ok", "x" * EVAL_TEXT_KEPT_CHARS], [1.0, 0.0])] and evals.refused == 1


@pytest.mark.parametrize("reward", [1e300, -1e300, 1e308, 3.5e38, float("inf"), float("nan"), True, "1"])
def test_an_evaluation_result_is_held_to_the_training_paths_reward_check(reward):
    """A reward of 1e300 is finite, so evaluation took it where training refuses it (one made eval/all/mean_reward
    7.8e297, two of 1e308 made it inf). Results now pass through the training path's own check
    (plausibility.reward_problem): refused, counted, and the prompt dealt again."""
    evals = rounds(1)
    evals.open(0, n=2, temperature=1.0, max_tokens=8)
    (deal,) = evals.deal("g1", 0, 1)
    problem = evals.result("g1", deal[0], [1.0, reward], [1, 1])
    assert problem is not None and reward_problem(reward) in problem and "[bad_reward]" in problem
    assert evals.refused == 1 and len(evals.deal("g2", 0, 1)) == 1 and evals.finished() == []
    assert reward_problem(3.4e38) is None and check_result([3.4e38, -1], [1, 1], n=2, max_tokens=8) is None


def test_a_late_round_is_abandoned_and_counted():
    clock = Clock()
    evals = rounds(2, clock)
    evals.open(2, n=1, temperature=0.0, max_tokens=4)
    evals.deal("g", 2, 1)
    clock.now = 61.0
    assert evals.expire() == [2] and evals.abandoned == 1 and evals.deal("g", 2, 1) == []


class Learner:
    """Answers one admit with an evaluation prompt and a training grant; records given-back evaluations."""

    def __init__(self):
        self.versions, self.given_back = [], []

    async def admit(self, want=1, version=None):
        self.versions.append(version)
        prompt = encode_prompt(PromptRow("t:0", [3], "a", None, {}))
        return AdmitReply(granted=1, evals=[EvalTask("e1", 7, prompt, 1, 0.0, 4)])

    async def release(self, count=1, deals=None, outcome="unused", rewards=None):
        return Status()

    async def eval_done(self, deal_id, rewards, lengths, texts=None):
        self.given_back.append((deal_id, rewards))
        return Status()


def test_the_admission_gate_tells_its_version_and_hands_evaluations_out_first():
    learner = Learner()
    gate = AdmissionGate(learner, on_reply=lambda reply: None, version_of=lambda: 7)

    async def scenario():
        got = await asyncio.gather(gate.take(), gate.take())
        await gate.close()
        return got

    got = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert isinstance(got[0], EvalTask) and got[0].version == 7 and got[1] is None
    assert learner.versions == [7]


@pytest.mark.parametrize("setting, why", [("weightsync.backend=engine_push", "staged"),
                                          ("tools.builtins=[python]", "episodes")])
def test_evaluation_during_training_is_left_out_with_a_reason_where_it_cannot_be_pinned(setting, why):
    extra = ["rollout.max_turns=2"] if "tools" in setting else ["generator.engine=vllm"]
    assert training_eval_blocker(load_config(None, ["eval.every_steps=3"])) is None
    assert why in training_eval_blocker(load_config(None, ["eval.every_steps=3", setting, *extra]))


def test_evaluation_during_training_runs_on_both_backends():
    assert training_eval_blocker(load_config(None, ["eval.every_steps=3", "buffer.backend=redis"])) is None


def test_which_published_versions_are_evaluated():
    def evaluated(published, start=0, every=4, before=True):
        next_due, out = first_due(start, every), []
        for version in published:
            due, next_due = eval_due(version, next_due, every, before)
            out += [version] if due else []
        return out

    assert evaluated(range(0, 10)) == [0, 4, 8]
    assert evaluated(range(0, 10), before=False) == [4, 8]
    assert evaluated([0, 3, 6, 9, 12]) == [0, 6, 9, 12]  # weightsync.every_steps=3: the first at or past each 4
    assert evaluated([8, 9, 10, 11, 12], start=8) == [8, 12]  # resumed at a due version: it is evaluated again
    assert evaluated([5, 6, 7, 8], start=5) == [8] and evaluated(range(5), every=0, before=False) == []
