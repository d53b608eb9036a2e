"""The NaN guard (learner/train_step.py, learner/loop.py): a step whose loss or gradient norm is not finite takes no
optimizer step, a batch that cannot be built raises PoisonedBatch, several skips in a row stop the job, the
adaptive KL ignores a non-finite KL, and a non-finite metric is counted and warned about, never dropped in silence."""
import copy
import logging
import time
from collections import Counter

import numpy as np
import pytest
import torch

from asyncrl.algos.config import AlgoConfig
from asyncrl.algos.kl import AdaptiveKLController
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.learner.build import StepParts
from asyncrl.learner.loop import TrainingPoisoned, skip_poisoned_step
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.state import LearnerState
from asyncrl.learner.train_step import PoisonedBatch, StepSettings, train_step


@pytest.fixture(scope="module")
def model():
    return build_qwen2(vocab_size=32, hidden_size=32, num_layers=1, eos_token_id=1, pad_token_id=0, seed=0)


def group(rewards, logprob=-1.0, prompt=(3, 4, 5)) -> Group:
    rng = np.random.default_rng(0)
    samples = [Sample(completion_ids=rng.integers(2, 32, 4).astype(np.int32), logprobs=np.full(4, logprob, np.float32),
                      versions=np.zeros(4, np.int32), reward=reward, finish_reason="stop") for reward in rewards]
    return Group(group_id="g", prompt_id="p", generator_id="t", prompt_ids=np.array(prompt, np.int32), samples=samples,
                 sampling=Sampling(temperature=1.0), created_at=time.time())


def step(model, groups, algo):
    """One train_step with AdamW on a copy; returns (its StepResult, the copy, its optimizer)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    settings = StepSettings(version=0, max_staleness=2, max_tokens_per_microbatch=1000, chunk_tokens=7, grad_clip=1.0)
    return train_step(model, optimizer, scheduler, groups, algo, settings), model, optimizer


def unchanged(before, after) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))


HUGE = 3e38  # finite in float32 (so plausible to the buffer), and its square overflows


@pytest.mark.parametrize("algo, groups", [
    # Dr. GRPO (no std): advantages of ±3e38, a loss of 1e35 and an inf gradient norm
    (AlgoConfig(norm_adv_by_std=False), [group([HUGE, -HUGE, HUGE, -HUGE])]),
    # behaviour logprobs of -100 with the bypass correction: the ratio overflows, the loss is inf, the gradient 0
    (AlgoConfig(norm_adv_by_std=False, correction="bypass"), [group([0.0, HUGE, 0.0, HUGE], logprob=-100.0)]),
])
def test_a_non_finite_loss_or_gradient_takes_no_optimizer_step(model, algo, groups):
    result, trained, optimizer = step(model, groups, algo)
    assert not result.stepped and not result.moved
    metrics = result.metrics
    assert metrics["learner/skipped"] == 1.0 and metrics["learner/skipped_minibatches"] == 1.0
    assert not (np.isfinite(metrics["loss/total"]) and np.isfinite(metrics["policy/grad_norm"]))
    assert unchanged(model, trained)  # weights, and so every later publish, stay as they were
    assert optimizer.state == {}  # AdamW's moments were never touched
    assert all(p.grad is None for p in trained.parameters())  # the poisoned gradient is gone


def test_a_finite_step_still_trains(model):
    result, trained, _ = step(model, [group([1.0, 0.0, 1.0, 0.0])], AlgoConfig(norm_adv_by_std=False))
    assert result.stepped and result.moved
    assert result.metrics["learner/skipped"] == 0.0 and not unchanged(model, trained)


def test_a_batch_without_gradient_steps_but_does_not_move_the_weights(model):
    """Every reward equal: every advantage is 0, the gradient is 0, and the version may repeat its bytes."""
    result, trained, _ = step(model, [group([1.0, 1.0, 1.0, 1.0])], AlgoConfig(norm_adv_by_std=False))
    assert result.stepped and not result.moved
    assert result.metrics["policy/grad_norm"] == 0.0


def test_a_non_finite_weight_is_never_stepped_on(model):
    broken = copy.deepcopy(model)
    with torch.no_grad():
        next(broken.parameters()).view(-1)[0] = float("nan")
    result, trained, optimizer = step(broken, [group([1.0, 0.0, 1.0, 0.0])], AlgoConfig())
    assert not result.stepped and result.metrics["learner/skipped"] == 1.0 and optimizer.state == {}


def test_a_batch_that_cannot_be_built_is_a_poisoned_batch_before_any_compute(model):
    """An empty prompt (which the buffer now rejects) crashed build_batch with a broadcast error."""
    with pytest.raises(PoisonedBatch, match="could not build the batch"):
        step(model, [group([1.0, 0.0], prompt=())], AlgoConfig())


class Quarantine:
    """Records what skip_poisoned_step does with the host (the buffer and the run's record are the host's parts)."""

    def __init__(self):
        self.quarantined, self.logged = [], []
        self.buffer, self.record = self, self

    def quarantine(self, groups, reason):
        self.quarantined.append(([g.group_id for g in groups], reason))

    def log(self, metrics, step):
        self.logged.append((metrics, step))


def test_consecutive_skips_stop_the_job_and_each_skip_leaves_the_version_and_kl_coefficient(caplog):
    state = LearnerState(version=4, kl_coef=0.2)
    parts = StepParts(ref_model=None, kl_controller=AdaptiveKLController(0.2, target=0.1, horizon=10.0),
                      batch_filter=None)
    host = Quarantine()
    groups = [group([1.0, 0.0])]
    with caplog.at_level(logging.WARNING, logger="asyncrl.learner.loop"):
        for _ in range(2):
            parts.kl_controller.value = float("nan")  # what a poisoned step's update would have left
            skip_poisoned_step(host, state, parts, groups, Counter(stale=1), "the loss was nan", max_in_a_row=3)
        with pytest.raises(TrainingPoisoned, match="3 steps in a row at v4.*max_consecutive_skips=3.*loss was nan"):
            skip_poisoned_step(host, state, parts, groups, Counter(), "the loss was nan", max_in_a_row=3)
    assert (state.version, state.skipped_steps, state.skipped_in_a_row) == (4, 3, 3)
    assert parts.kl_controller.value == 0.2
    assert state.dropped_total["poisoned_step"] == 3 and state.groups_consumed == 0
    assert host.quarantined == [(["g"], "poisoned_step")] * 3
    assert host.logged[-1] == ({"learner/skipped_steps": 3.0}, 4)
    assert "skipped the step (the loss was nan); groups ['g'] from ['t'] are quarantined" in caplog.text


def test_the_adaptive_kl_controller_ignores_a_non_finite_kl():
    controller = AdaptiveKLController(0.2, target=0.1, horizon=10.0)
    for kl in (float("nan"), float("inf")):
        controller.update(kl, n_steps=1)
    assert controller.value == 0.2
    controller.update(0.2, n_steps=1)
    assert controller.value > 0.2


def test_a_non_finite_metric_is_counted_and_warned_about_once(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    from asyncrl.telemetry.mlflow_logger import MetricsLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("nan")).info.run_id
    metrics_log = MetricsLogger(uri, run_id)
    with caplog.at_level(logging.WARNING, logger="asyncrl.telemetry.mlflow_logger"):
        metrics_log.log({"loss/total": float("nan"), "policy/grad_norm": float("inf"), "reward/mean": 0.5}, step=1)
        metrics_log.log({"loss/total": float("nan"), "reward/mean": 0.6}, step=2)
        metrics_log.close()
    history = {m.step: m.value for m in client.get_metric_history(run_id, "telemetry/non_finite_metrics")}
    assert history == {1: 2.0, 2: 1.0} and metrics_log.non_finite == 3
    assert [m.value for m in client.get_metric_history(run_id, "reward/mean")] == [0.5, 0.6]
    warnings = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(warnings) == 1 and "loss/total, policy/grad_norm" in warnings[0]
