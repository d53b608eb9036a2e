"""The learner's side of evaluation rounds (learner/evals.py): rounds open for the due published versions, and
each finished round is logged at the step it evaluated, with how far training had moved on since."""
import logging
from types import SimpleNamespace

from asyncrl.buffer.eval_rounds import EvalRounds
from asyncrl.data.prompts import PromptRow, encode_prompts
from asyncrl.learner.evals import Evaluations



class Record:
    def __init__(self):
        self.logged = []

    def log_eval(self, step, metrics):
        self.logged.append((step, metrics))


EVAL = SimpleNamespace(every_steps=2, before_train=True, n=2, temperature=0.0, k_values=[1], pass_threshold=0.5,
                       timeout_s=0.5)


def test_due_versions_open_rounds_and_a_finished_round_is_logged_at_its_own_step(caplog):
    caplog.set_level(logging.INFO, logger="asyncrl.learner.evals")
    rows = [PromptRow(f"t:{i}", [3, 4], "a", None, {}) for i in range(2)]
    rounds = EvalRounds(encode_prompts(rows), timeout_s=60.0)
    record = Record()
    evals = Evaluations(rounds, EVAL, max_tokens=8, start_version=0, record=record,
                        source="eval.files: test.parquet")
    for version in (0, 1, 3):  # before training; not due; the first published at or past 2
        evals.open_if_due(version)
    assert rounds.open_versions() == [0, 3]
    for deal in rounds.deal("g", 0, 2):
        assert rounds.result("g", deal[0], [1.0, 0.0], [3, 8]) is None
    assert evals.after_step(published=3) == {"eval/rounds_abandoned": 0.0}
    ((step, metrics),) = record.logged
    assert step == 0 and metrics["eval/lag_steps"] == 3.0 and metrics["eval/all/mean_reward"] == 0.5
    assert "evaluation of v0 on eval.files: test.parquet: mean reward 0.5000" in caplog.text  # names its data
    evals.finish(published=3, live_generators=lambda: [])  # nobody left to answer v3: no wait
    assert rounds.open_versions() == [3] and len(record.logged) == 1


def test_a_job_without_evaluation_prompts_opens_and_logs_nothing():
    evals = Evaluations(None, EVAL, max_tokens=8, start_version=0, record=Record())
    evals.open_if_due(0)
    assert evals.after_step(published=0) == {} and evals.log_finished(0) == 0
    evals.finish(published=0, live_generators=lambda: ["g"])
