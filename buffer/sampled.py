"""The reward of everything the policy sampled, as the learner hears of it: one tally per learner, both backends.

With algo.dynamic_sampling a generator drops a group whose rewards are all equal before sending it (it teaches
nothing under a group baseline) and only releases its admission (`GeneratorBuffer.release`). The learner's own
`reward/mean` then covers the groups it trained on, which over-states what the policy samples: the all-0 groups
are gone (measured on a user's task: 0.487 -> 0.684 printed while the policy sampled 0.319 -> 0.659). So the release
of a filtered group carries that group's rewards (`rewards` in the request), and the learner's buffer adds them here
beside the rewards of every group it takes (trained, or dropped while assembling a batch: stale, zero variance).
`take_window` turns what arrived since the last step into that step's `reward/sampled_*` metrics, and `seen`
summarises everything since the learner started, for the check that the job can learn at all
(learner/learnable.py).

A release's rewards come from a generator, so they are hostile input: `check_released_rewards` refuses anything
but a list of at most `rollout.n` finite numbers (the caller counts the refusal and ignores the rewards, and the
release itself still frees its admission). The zmq server adds them only when the release gave an admission back,
so a generator cannot report more groups than it was granted. Pure stdlib; the zmq server adds from its own thread,
so the tally takes a lock.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass

MAX_GROUP_SIZE = 4096
"""The most rewards a release may carry when the job's group size is not known (the learner always knows it)."""
MAX_DISTINCT_VALUES = 8
"""Equal-reward values kept apart in `seen`'s histogram; further values are counted together (`other`), so a
generator sending a new value each time cannot grow the learner's memory."""
FLOAT32_MAX = 3.4028234663852886e38


def check_released_rewards(rewards, group_size: int | None) -> str | None:
    """Why the `rewards` a release carries are not usable (None: they are): a list of 1 to `group_size` (rollout.n;
    None: MAX_GROUP_SIZE) finite numbers within float32's range, the dtype rewards are trained in."""
    limit = group_size or MAX_GROUP_SIZE
    if not isinstance(rewards, (list, tuple)):
        return f"rewards must be a list of numbers, got {type(rewards).__name__}"
    if not 1 <= len(rewards) <= limit:
        return f"{len(rewards)} rewards, expected 1 to {limit} (rollout.n)"
    for index, value in enumerate(rewards):
        if type(value) not in (int, float) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            return f"rewards[{index}] = {str(value)[:40]!r} is not a finite number"
    return None


@dataclass(frozen=True)
class SampledSoFar:
    """Every group the learner heard of since it started: how many, how many had rewards that differ within the
    group (the only ones a group baseline learns from), and the equal ones' values."""

    groups: int
    varied_groups: int
    equal_values: tuple = ()
    """((reward, groups), ...) of the groups whose rewards were all equal, most frequent first (at most
    MAX_DISTINCT_VALUES values)."""
    equal_other: int = 0
    """Equal-reward groups at further values."""

    @property
    def equal_groups(self) -> int:
        return self.groups - self.varied_groups


class SampledRewards:
    """The tally (see the module docstring): `add` one group's rewards, `take_window` per step, `seen` since start."""

    def __init__(self):
        self._lock = threading.Lock()
        self._window = (0, 0, 0.0, 0)  # groups, samples, sum of rewards, equal-reward groups since take_window
        self._groups = 0
        self._varied = 0
        self._equal_values: Counter = Counter()
        self._equal_other = 0

    def add(self, rewards) -> None:
        """One group's rewards (valid numbers: a taken group passed the codec, a released one
        check_released_rewards)."""
        values = [float(value) for value in rewards]
        if not values:
            return
        equal = max(values) == min(values)
        with self._lock:
            groups, samples, total, equal_groups = self._window
            self._window = (groups + 1, samples + len(values), total + sum(values), equal_groups + equal)
            self._groups += 1
            if not equal:
                self._varied += 1
            elif values[0] in self._equal_values or len(self._equal_values) < MAX_DISTINCT_VALUES:
                self._equal_values[values[0]] += 1
            else:
                self._equal_other += 1

    def take_window(self) -> dict:
        """The reward of every sample of every group added since the last call, and those groups' count and share
        with equal rewards, as the step's metrics; {} when none was added."""
        with self._lock:
            (groups, samples, total, equal_groups), self._window = self._window, (0, 0, 0.0, 0)
        if not groups:
            return {}
        return {"reward/sampled_mean": total / samples, "reward/sampled_groups": float(groups),
                "reward/sampled_frac_zero_std_groups": equal_groups / groups}

    def seen(self) -> SampledSoFar:
        with self._lock:
            return SampledSoFar(self._groups, self._varied, tuple(self._equal_values.most_common()),
                                self._equal_other)
