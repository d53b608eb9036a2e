"""Failing fast when nothing can be learned: the first groups of a job all had equal rewards.

Under a group baseline (GRPO and its kin) a group whose samples all scored alike has every advantage 0. A model
that never scores (a reward function that cannot parse its answers, a warm start that never learned the format)
produces only such groups; with algo.dynamic_sampling the generators drop every one, no batch ever fills, and the
learner used to say so only at learner.wait_for_batch_timeout_s (600 s; a user's job dropped 30,156 groups
first). This watch reads the learner's tally of every group sampled (buffer/sampled.py) while the learner waits
for a batch: once `algo.unlearnable_after_groups` groups have arrived and none had rewards that differ, it stops
the job (NothingToLearn) with the rewards seen and what to check. Without dynamic sampling those groups are
trained, uselessly, so it warns once instead. One group with differing rewards disarms it for good: a policy that
learns and later saturates (every group all 1) is not a broken job.

The decision is on evidence, not time. A policy that solves a prompt with probability p per sample gives a group of
n samples that all score alike with probability about 1 - n p for small p, so N groups all alike with about
(1 - n p)^N: for the default N = 1024, 3e-5 at n = 2 and p = 0.005 (the e2e tests' 20-step warm start samples 0.5%
correct answers: at N = 256 it would trip 8% of the time), 1e-9 at n = 4. A job that cannot learn drops 1024
groups in about 20 s on the CPU demo (the user's job above dropped 50 a second).
"""
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncrl.buffer.sampled import SampledSoFar

log = logging.getLogger(__name__)
EARLY_WARNING_S = 60.0
"""A job whose every group so far scored alike says so this long after its first group, before it has the evidence
to stop (algo.unlearnable_after_groups)."""


class NothingToLearn(RuntimeError):
    """The first algo.unlearnable_after_groups groups all had equal rewards, with algo.dynamic_sampling on: no batch
    can fill. The message shows the rewards seen and what to check."""


def is_unlearnable(seen: SampledSoFar, after_groups: int) -> bool:
    """At least `after_groups` groups heard of (0: never decide), and none with rewards that differ."""
    return after_groups > 0 and seen.groups >= after_groups and seen.varied_groups == 0


def describe_rewards(seen: SampledSoFar) -> str:
    """'1840 groups sampled, all with equal rewards: 1800 at 0.0, 40 at 1.0' (at most the tally's distinct values,
    the rest counted together)."""
    parts = [f"{count} at {round(value, 6)}" for value, count in seen.equal_values]
    if seen.equal_other:
        parts.append(f"{seen.equal_other} at other values")
    return f"{seen.groups} groups sampled, all with equal rewards: {', '.join(parts)}"


def unlearnable_message(seen: SampledSoFar, after_groups: int, dynamic_sampling: bool) -> str:
    consequence = ("algo.dynamic_sampling drops every one of them, so no batch can fill and the job stops here "
                   if dynamic_sampling else
                   "each group's advantages are all 0, so the steps train on nothing (the job goes on) ")
    return (f"nothing to learn: {describe_rewards(seen)}. Within a group the samples all scored alike, and "
            f"{consequence}(after algo.unlearnable_after_groups={after_groups}). Check: the reward function (does "
            f"it give a correct answer a different score? try it on one), the warm start (does the model produce "
            f"the answer's format at all? `asyncrl sft` it first), rollout.temperature and rollout.n (more varied "
            f"samples), and algo.dynamic_sampling. To wait anyway: algo.unlearnable_after_groups=0.")


@dataclass
class LearnableWatch:
    """The check, armed until the first group with differing rewards; `sampled_so_far` is the buffer's
    (interface.LearnerBuffer.sampled_so_far)."""

    sampled_so_far: Callable[[], SampledSoFar]
    after_groups: int
    dynamic_sampling: bool
    armed: bool = True
    early_warning_s: float = EARLY_WARNING_S
    clock: Callable[[], float] = time.monotonic
    _first_group_at: float | None = None
    _warned_early: bool = False

    def check(self, may_stop: bool = True, data_ended: bool = False) -> None:
        """Raise NothingToLearn (dynamic sampling, where `may_stop`: rank 0 while it collects a batch, whose errors
        reach the other ranks), or warn once, when the job cannot learn. `data_ended`: the last epoch's prompts
        (data.epochs) are all taken with the batch still empty; then every group the data gave is the evidence,
        however few (else the job would end with no step and nothing said)."""
        if not self.armed or self.after_groups <= 0:
            return
        seen = self.sampled_so_far()
        if seen.varied_groups:
            self.armed = False
            return
        self._warn_early(seen)
        if is_unlearnable(seen, 1 if data_ended else self.after_groups):
            message = unlearnable_message(seen, self.after_groups, self.dynamic_sampling)
            if self.dynamic_sampling and may_stop:
                raise NothingToLearn(message)
            self.armed = False
            log.warning("learner: %s", message)

    def _warn_early(self, seen: SampledSoFar) -> None:
        """A slow fleet (a large model, long answers) may take many minutes to sample after_groups groups; the
        user hears within EARLY_WARNING_S of the first group that every group so far scored alike, once."""
        if seen.groups and self._first_group_at is None:
            self._first_group_at = self.clock()
        if (self._warned_early or self._first_group_at is None or seen.groups >= self.after_groups
                or self.clock() - self._first_group_at < self.early_warning_s):
            return
        self._warned_early = True
        log.warning("learner: %s so far (%.0f s since the first); the job %s after algo.unlearnable_after_groups=%d "
                    "such groups. Check the reward function and the warm start now.", describe_rewards(seen),
                    self.clock() - self._first_group_at, "stops" if self.dynamic_sampling else "warns",
                    self.after_groups)
