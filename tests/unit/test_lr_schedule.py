"""The learner's learning-rate schedule (learner/lr_schedule.py) against hand-computed values, through the real
optimizer, and its refusals."""
import math

import pytest
import torch

from asyncrl.learner.build import build_optimizer
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.lr_schedule import lr_multiplier


def test_warmup_then_constant_as_before():
    rates = [lr_multiplier(step, warmup_steps=3, total_steps=10) for step in range(6)]
    assert rates == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_and_cosine_decay_to_the_minimum_ratio():
    linear = [lr_multiplier(step, warmup_steps=2, total_steps=6, schedule="linear", min_ratio=0.2)
              for step in range(8)]
    # warmup 1/3, 2/3; then progress 0, 1/4, 1/2, 3/4, 1, and held at the floor past total_steps
    assert linear == pytest.approx([1 / 3, 2 / 3, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    cosine = [lr_multiplier(step, warmup_steps=0, total_steps=4, schedule="cosine", min_ratio=0.1)
              for step in range(5)]
    by_hand = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75, 1.0)]
    assert cosine == pytest.approx(by_hand) and cosine[2] == pytest.approx(0.55)


def test_the_optimizer_follows_the_schedule():
    model = torch.nn.Linear(2, 1)
    optimizer, scheduler = build_optimizer(model, LearnerConfig(lr=1.0, warmup_steps=1, total_steps=3,
                                                                lr_schedule="linear", min_lr_ratio=0.0))
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5, 1.0, 0.5, 0.0])


@pytest.mark.parametrize("kwargs, match", [
    ({"lr_schedule": "step"}, "lr_schedule"),
    ({"lr_schedule": "cosine", "min_lr_ratio": 1.5}, "min_lr_ratio"),
    ({"min_lr_ratio": 0.1}, "does not decay"),
])
def test_schedules_that_do_not_combine_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LearnerConfig(**kwargs)


def test_a_resumed_optimizer_takes_its_first_step_at_this_jobs_schedule(tmp_path):
    """The previous life decayed over 4 steps; this one over 8: after loading, the rate is the new schedule's at
    the restored step, not the rate the old schedule left in the optimizer."""
    from asyncrl.learner.lr_schedule import resync_after_load

    def build(total):
        model = torch.nn.Linear(2, 1)
        return model, *build_optimizer(model, LearnerConfig(lr=1.0, warmup_steps=0, total_steps=total,
                                                            lr_schedule="linear"))

    model, optimizer, scheduler = build(4)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    saved = (optimizer.state_dict(), scheduler.state_dict())
    model, optimizer, scheduler = build(8)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    resync_after_load(scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # step 4 of 8


def test_a_job_shorter_than_its_warmup_is_allowed_stays_in_warmup_and_says_so(caplog):
    """A smoke run of the cosine recipe (`learner.total_steps=3` under a 10-step warmup) is not an error: the rate
    only rises, and the learner's log says the decay never starts."""
    model = torch.nn.Linear(2, 1)
    with caplog.at_level("WARNING", logger="asyncrl.learner.build"):
        optimizer, scheduler = build_optimizer(model, LearnerConfig(lr=1.0, warmup_steps=10, total_steps=3,
                                                                    lr_schedule="cosine"))
    seen = []
    for _ in range(3):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1 / 11, 2 / 11, 3 / 11])
    assert "decay never starts" in caplog.text and "0.273" in caplog.text
