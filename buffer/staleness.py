"""The one definition of versions, staleness and admission (docs/architecture.md §4).

Two versions, which differ when weights are published every `weightsync.every_steps = k > 1` steps:
- the **trained version** v_t: the optimizer steps the learner has done (`learner/state.py::LearnerState.version`,
  the version of the weights the next step trains). Staleness is measured against it.
- the **published version** v_p: the newest version whose weights were published and announced
  (`Coordinator.set_version`, called only after the publish). Admission is paced by it. v_p <= v_t, and
  v_t - v_p < k (the last step's weights are always published).

The rules:
- A group's staleness, when the learner takes it, is v_t - min(versions of its tokens).
- The learner never trains on a group with staleness > η (`max_staleness`).
- Admission (AReaL): a generator may start a group only while started < (L + v_p + 1) * groups_per_step, where L is
  the admission lead (η by default; `buffer.admission_lead` sets it lower, pacing the fleet) and
  `started` counts every admitted group that was not given back (dropped, rejected, held by a generator that left,
  or released by the generator that holds it because its own filter dropped the group).

Why this bound holds: group k (0-based, in admission order) is admitted while k < (L + v_a + 1) * B, v_a being the
published version then, and it is sampled with weights of version >= v_a, because a generator loads the newest
version it knows of before it starts a group. When groups are consumed in admission order it is trained at a
trained version <= L + v_a <= η + v_a. Pacing by the published version, which lags the trained one, only admits
less. With L < η the fleet runs less far ahead (the mean staleness sits near L), and a group that arrives late is
still trained up to η instead of dropped. Out-of-order delivery (one slow generator) can still exceed the bound,
which is why the learner re-checks every group it takes.
"""
import threading
from collections import defaultdict


def group_staleness(trained_version: int, min_token_version: int) -> int:
    """How many optimizer steps the learner took since the oldest weights that sampled the group."""
    return trained_version - min_token_version


def is_too_stale(trained_version: int, min_token_version: int, max_staleness: int) -> bool:
    return group_staleness(trained_version, min_token_version) > max_staleness


def admission_capacity(lead: int, published_version: int, groups_per_step: int, started: int) -> int:
    """Groups that may still start now, `lead` versions (η, or buffer.admission_lead) ahead of the published
    version."""
    return max(0, (lead + published_version + 1) * groups_per_step - started)


class Coordinator:
    """Admission and version bookkeeping shared by the buffer server thread and the learner. Thread-safe.

    Consumes: admission requests (per generator), delivered groups, given-back groups, published versions.
    Holds: per-generator outstanding admissions, so a generator that leaves gives its capacity back. Its `version`
    is the published one (module docstring): it never hears of a step before its weights are out.
    """

    def __init__(self, lead: int, groups_per_step: int, version: int = 0):
        self.lead = lead  # η, or buffer.admission_lead when pacing is set (BufferConfig.lead_steps)
        self.groups_per_step = groups_per_step
        self._version = version
        self._started = version * groups_per_step  # a resumed learner published and trained v: it consumed v * B
        self._outstanding = defaultdict(int)
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The published version (admission's v_p)."""
        return self._version

    @property
    def started(self) -> int:
        return self._started

    def set_version(self, version: int) -> None:
        """Called after the weights of `version` are published, never before (see module docstring)."""
        with self._lock:
            self._version = max(self._version, version)

    def try_admit(self, generator_id: str, want: int = 1) -> int:
        """Grants up to `want` new groups to `generator_id`; returns how many were granted."""
        with self._lock:
            cap = admission_capacity(self.lead, self._version, self.groups_per_step, self._started)
            granted = min(want, cap)
            self._started += granted
            self._outstanding[generator_id] += granted
            return granted

    def delivered(self, generator_id: str) -> bool:
        """A group from `generator_id` arrived (valid or not): it no longer holds that admission. Returns whether
        it held one (a group sent without asking, or after its admissions were reclaimed, did not)."""
        with self._lock:
            if self._outstanding.get(generator_id, 0) > 0:
                self._outstanding[generator_id] -= 1
                return True
            return False

    def release(self, generator_id: str, count: int = 1) -> int:
        """`generator_id` will not deliver `count` of the groups it was admitted for (its own filter dropped them,
        algo.dynamic_sampling): that capacity returns at once, instead of when the learner would have taken and
        dropped them. Never more than it holds, so no generator can free capacity it did not take. Returns how many
        were released."""
        with self._lock:
            released = max(0, min(int(count), self._outstanding.get(generator_id, 0)))
            if released:
                self._outstanding[generator_id] -= released
                self._started = max(0, self._started - released)
            return released

    def give_back(self, count: int = 1, token: str = "") -> None:
        """Admitted groups that will never be trained (stale, rejected, aborted) free their capacity. `token` is
        for the Redis coordinator's idempotence; in memory there is no resend to guard against."""
        with self._lock:
            self._started = max(0, self._started - count)

    def forget_generator(self, generator_id: str) -> int:
        """A generator left or died: the groups it was admitted for but never delivered are given back."""
        with self._lock:
            held = self._outstanding.pop(generator_id, 0)
            self._started = max(0, self._started - held)
            return held

    def outstanding(self) -> dict:
        with self._lock:
            return dict(self._outstanding)
