"""Taking a batch of groups from the buffer, with the staleness check of DESIGN.md §4 applied to every group."""
import time
from dataclasses import dataclass, field

from asyncrl.buffer.staleness import group_staleness, is_too_stale


class BatchTimeout(RuntimeError):
    """No full batch arrived in time; the message names the generators last seen."""


@dataclass
class Collected:
    groups: list
    staleness: list = field(default_factory=list)
    dropped_stale: int = 0
    wait_s: float = 0.0


def collect_batch(server, coordinator, groups_per_step: int, max_staleness: int, version: int,
                  timeout_s: float) -> Collected:
    """Take groups until `groups_per_step` fresh ones are in hand. Stale groups are dropped, counted, given back."""
    started = time.monotonic()
    out = Collected(groups=[])
    while len(out.groups) < groups_per_step:
        remaining = timeout_s - (time.monotonic() - started)
        if remaining <= 0:
            live = server.live_generators()
            raise BatchTimeout(
                f"learner v{version}: only {len(out.groups)}/{groups_per_step} groups after {timeout_s:.0f} s; "
                f"generators seen recently: {live or 'none'} (start one with `asyncrl generator --config ...`)")
        group = server.take(min(remaining, 1.0))
        if group is None:
            continue
        oldest = group.min_version()
        if oldest < 0:  # no completion tokens at all: nothing to learn from
            coordinator.give_back(1)
            continue
        if is_too_stale(version, oldest, max_staleness):
            out.dropped_stale += 1
            coordinator.give_back(1)
            continue
        out.groups.append(group)
        out.staleness.append(group_staleness(version, oldest))
    out.wait_s = time.monotonic() - started
    return out
