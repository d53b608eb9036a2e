"""Taking a batch of groups from the buffer, with the staleness check of docs/architecture.md §4 applied to every
group.

Batch assembly also applies the filters that decide what a step may train on, each counted, never silent:
- stale groups (staleness > η) are dropped;
- with DAPO dynamic sampling, groups whose rewards are all equal carry no gradient under a group baseline and are
  dropped, and the learner keeps pulling until the batch is full;
- groups without the greedy `baseline_reward` ReMax needs are dropped with a log line (groups of the wrong size, and
  others no generator of this job could produce, never get here: the buffer rejects them, buffer/plausibility.py).
Every dropped group's admission is given back, so the generators are allowed to replace it.
"""
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from asyncrl.buffer.staleness import group_staleness, is_too_stale
from asyncrl.learner.trust import QUARANTINE_HINT

log = logging.getLogger(__name__)


class BatchTimeout(RuntimeError):
    """No full batch arrived in time; the message names the generators last seen."""


@dataclass
class Collected:
    groups: list
    staleness: list = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    """reason -> groups dropped while assembling this batch (stale, zero_variance, no_baseline, empty)."""
    refused: Counter = field(default_factory=Counter)
    """generator -> its groups refused while assembling this batch (quarantined: learner/trust.py); not drops."""
    wait_s: float = 0.0
    final: bool = False
    """The data ran out (data.epochs, buffer/dealing.py): these groups, however few, are the job's last."""

    @property
    def dropped_stale(self) -> int:
        return self.dropped["stale"]


@dataclass
class BatchFilter:
    """What a group must satisfy to be trained on, besides staleness."""

    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (DAPO)."""
    needs_baseline: bool = False
    """Require meta['baseline_reward'] (ReMax)."""


def drop_reason(group, batch_filter: BatchFilter) -> str | None:
    """Why the group cannot be trained on (besides staleness), or None."""
    if batch_filter.needs_baseline:
        baseline = group.meta.get("baseline_reward")
        if not isinstance(baseline, (int, float)) or not math.isfinite(baseline):
            return "no_baseline"
    if batch_filter.dynamic_sampling:
        if group.zero_variance():
            return "zero_variance"
    return None


def waiting_message(buffer, out: Collected, groups_per_step: int, version: int, waited_s: float) -> str:
    """Why the batch is not full yet, in the learner's words: the groups in hand, what was dropped here, the
    generators heard from, and the zero-variance groups they dropped before sending (algo.dynamic_sampling) --
    an untrained or collapsed policy that scores every sample alike fills no batch, and says so."""
    live = buffer.live_generators()
    filtered = int(buffer.metrics().get("generator/filtered_groups", 0))
    message = (f"learner v{version}: {len(out.groups)}/{groups_per_step} groups after {waited_s:.0f} s "
               f"(dropped so far: {dict(out.dropped) or 'none'}); generators seen recently: {live or 'none'}")
    if not live:
        message += " (start one with `asyncrl generator --config ...`)"
    if filtered:
        message += (f"; they dropped {filtered} groups whose samples all scored alike before sending "
                    f"(algo.dynamic_sampling: a policy that scores every sample the same fills no batch)")
    if out.refused:
        message += (f"; refused the groups of quarantined generators {dict(out.refused)} (learner/trust.py). "
                    f"{QUARANTINE_HINT}")
    return message


def collect_batch(buffer, groups_per_step: int, max_staleness: int, trained_version: int, timeout_s: float,
                  batch_filter: BatchFilter | None = None, report_every_s: float = 30.0,
                  data_done=None, watch=None, refuse=None) -> Collected:
    """Take groups from `buffer` (an `interface.LearnerBuffer`) until `groups_per_step` usable ones are in hand,
    or, once `data_done()` says every prompt of the last epoch was taken, with what is in hand (`final`).
    Staleness is measured against `trained_version` (optimizer steps done, buffer/staleness.py), not the
    published one. Dropped groups are counted and given back. A wait longer than `report_every_s` says why in the
    log, again each `report_every_s`, so a starved learner is never silent until its timeout. `watch()`, called
    before each take (so at least once a second), may stop the wait with an error of its own
    (learner/learnable.py: a job whose groups all score alike). `refuse(group)`: why a group must not be trained
    (its generator is quarantined: learner/trust.py), or None; such a group is quarantined in the buffer, which
    counts it once, under buffer/rejected/quarantined (not among this batch's drops)."""
    started = time.monotonic()
    next_report = started + report_every_s
    out = Collected(groups=[])
    while len(out.groups) < groups_per_step:
        now = time.monotonic()
        remaining = timeout_s - (now - started)
        if remaining <= 0:
            raise BatchTimeout(f"only {waiting_message(buffer, out, groups_per_step, trained_version, timeout_s)}")
        if watch is not None:
            watch()
        if now >= next_report:
            log.warning("still waiting for a batch: %s",
                        waiting_message(buffer, out, groups_per_step, trained_version, now - started))
            next_report = now + report_every_s
        group = buffer.take(min(remaining, 0.2 if data_done is not None else 1.0))
        if group is None:
            if data_done is not None and data_done():
                if watch is not None and not out.groups:  # all the data gave, and nothing to train on
                    watch(data_ended=True)
                out.final = True
                break
            continue
        refused = refuse(group) if refuse is not None else None
        if refused is not None:
            buffer.quarantine([group], "quarantined", refused)
            out.refused[group.generator_id] += 1
            continue
        oldest = group.min_version()
        if oldest < 0:  # no completion tokens at all: nothing to learn from
            reason = "empty"
        elif is_too_stale(trained_version, oldest, max_staleness):
            reason = "stale"
        else:
            reason = drop_reason(group, batch_filter) if batch_filter else None
        if reason is not None:
            if reason == "no_baseline" and out.dropped[reason] == 0:
                log.warning("learner v%d: dropping group %s from %s (%s)", trained_version, group.group_id,
                            group.generator_id, reason)
            out.dropped[reason] += 1
            buffer.give_back(group, reason)
            continue
        out.groups.append(group)
        out.staleness.append(group_staleness(trained_version, oldest))
    out.wait_s = time.monotonic() - started
    return out
