"""The soak's fault schedule: which fault, on which process, when, and for how long, drawn from a seed before the
job starts, so a failing soak is replayed by running it again with the same seed.

Faults are spread over the run, not bunched: the run is cut into as many equal slots as there are faults, each fault
lands at a random point of its own slot (in a random order of kinds), and nothing is injected in the first
`warmup_s` (the job must train before it can be shown to recover) or the last `cooldown_s` (the history checker needs
steps after the last fault to see that training went on). A fault with a duration (a stop, a partition, a slow
link, a full disk) ends within its slot, so two faults overlap only when the run is too short for its faults: the
schedule then says so rather than stacking them silently.
"""
import random
from dataclasses import dataclass

KINDS = ("kill_generator", "stop_generator", "kill_learner", "kill_redis", "partition", "slow_link",
         "kill_during_load", "full_disk", "hostile")
"""Every fault the soak injects (bench/soak/run.py carries each out):
- kill_generator: SIGKILL a generator, start it again after `duration_s` under the same id;
- stop_generator: SIGSTOP a generator for `duration_s` (longer than the lease), then SIGCONT;
- kill_learner: SIGKILL the learner, resume it from its last checkpoint;
- kill_redis: SIGKILL redis-server, start it again on its append-only file (the Redis variant only);
- partition: the link between a generator's network namespace and the learner's goes down for `duration_s`;
- slow_link: that link is rate-limited (tc tbf) for `duration_s`;
- kill_during_load: SIGKILL a generator while it loads a new version's weights, then start it again;
- full_disk: the checkpoint directory's filesystem is filled for `duration_s`;
- hostile: the rogue generator sends a burst of malformed and implausible groups."""
GENERATOR_FAULTS = ("kill_generator", "stop_generator", "partition", "slow_link", "kill_during_load")
"""Faults aimed at one generator (the target is drawn among them)."""


@dataclass(frozen=True)
class Fault:
    at_s: float
    """Seconds after the job started."""
    kind: str
    target: str
    """The generator's id for GENERATOR_FAULTS; "learner", "redis", "checkpoints" or "rogue" otherwise."""
    duration_s: float = 0.0


def target_of(kind: str, generators: list, rng: random.Random) -> str:
    if kind in GENERATOR_FAULTS:
        return rng.choice(generators)
    return {"kill_learner": "learner", "kill_redis": "redis", "full_disk": "checkpoints", "hostile": "rogue"}[kind]


def make_schedule(seed: int, duration_s: float, counts: dict, generators: list, warmup_s: float, cooldown_s: float,
                  durations: dict) -> list:
    """The faults of one soak, in time order: `counts` kind -> how many, `durations` kind -> seconds each lasts
    (0 or absent: instant). Raises ValueError when the faults cannot fit apart in the window."""
    unknown = sorted(set(counts) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}: the soak knows {', '.join(KINDS)}")
    rng = random.Random(seed)
    kinds = [kind for kind in KINDS for _ in range(counts.get(kind, 0))]
    rng.shuffle(kinds)
    window = duration_s - warmup_s - cooldown_s
    if not kinds:
        return []
    slot = window / len(kinds) if window > 0 else 0.0
    longest = max(durations.get(kind, 0.0) for kind in kinds)
    if slot <= longest:
        raise ValueError(f"{len(kinds)} faults in a {window:.0f} s window leave {slot:.1f} s each, not more than the "
                         f"longest fault ({longest:.0f} s): run longer or inject fewer")
    faults = []
    for index, kind in enumerate(kinds):
        length = durations.get(kind, 0.0)
        at = warmup_s + index * slot + rng.uniform(0.0, slot - length)
        faults.append(Fault(round(at, 2), kind, target_of(kind, generators, rng), length))
    return faults
