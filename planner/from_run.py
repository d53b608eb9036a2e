"""The planner's inputs, measured from a finished job directory, and what that job achieved (to check a plan).

A job directory holds what is needed: `progress.jsonl` (every step: wall clock, the learner's wait for its batch,
the fleet's tokens/s and idle fraction, staleness), `trained_groups.jsonl` (each trained sample's completion
length) and `summary.json` (the generators that joined). The first `warmup_frac` of the steps are left out: the
engines' start and the first admissions are not the steady state a plan is about.
"""
import json
import os
import statistics
from dataclasses import dataclass

from asyncrl.planner.simulate import MAX_FILTER_FRAC


@dataclass
class Measured:
    generators: int
    gen_tokens_per_s: float
    """Completion tokens/s of one generator while busy (the fleet's rate / generators / (1 - idle))."""
    train_s_per_step: float
    """Mean wall time of a step less the learner's wait for its batch: train, publish, log, and the odd checkpoint
    (the mean, as a learner-bound job's steps/s is 1 / it)."""
    lengths: list
    """Completion lengths, per trained group."""
    steps_per_s: float
    staleness_mean: float
    learner_idle_frac: float
    generator_idle_frac: float
    steps: int
    groups_per_step: int
    n: int
    """Samples per group."""
    filter_frac: float = 0.0
    """The share of sampled groups dynamic sampling dropped: filtered / (filtered + trained)."""


def read_jsonl(path: str) -> list:
    rows = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a half-written last line
                    continue
    return rows


def measure_run(job_dir: str, warmup_frac: float = 0.2) -> Measured:
    progress_path = os.path.join(job_dir, "progress.jsonl")
    groups_path = os.path.join(job_dir, "trained_groups.jsonl")
    for path in (progress_path, groups_path):
        if not os.path.isfile(path):
            raise ValueError(f"{job_dir} is not a finished asyncrl job directory: {os.path.basename(path)} is missing")
    rows = read_jsonl(progress_path)
    if len(rows) < 5:
        raise ValueError(f"{progress_path} has {len(rows)} steps; a plan needs a run of at least 5")
    skip = max(1, int(len(rows) * warmup_frac))
    steady = rows[skip:]
    walls = [later["elapsed_s"] - earlier["elapsed_s"] for earlier, later in zip(rows[skip - 1:], steady)]
    busy = [wall - row.get("timing/learner/wait_for_batch_s", 0.0) for wall, row in zip(walls, steady)]
    generators = _generator_count(job_dir)
    fleet_rate = statistics.mean(row.get("perf/generator/tokens_per_s", 0.0) for row in steady)
    gen_idle = statistics.mean(row.get("timing/generator/idle_frac", 0.0) for row in steady)
    trained = read_jsonl(groups_path)
    lengths = [group for row in trained[skip:] for group in row.get("lengths", [])]
    if not lengths:
        raise ValueError(f"{groups_path} records no completion lengths (a job from before asyncrl recorded them); "
                         f"give the length distribution with --mean-len and --len-cv instead")
    groups_per_step = statistics.mode(len(row["groups"]) for row in trained)
    filter_frac = filtered_fraction(rows[skip - 1:], groups_per_step)
    if filter_frac > MAX_FILTER_FRAC:
        raise ValueError(f"{progress_path}: the generators reported {filter_frac:.2%} of their groups filtered by "
                         f"dynamic sampling (over {MAX_FILTER_FRAC:.0%} is a run that barely trained, or reports that "
                         f"cannot be trusted); give --filter-frac with the flags instead")
    return Measured(
        generators=generators,
        gen_tokens_per_s=fleet_rate / generators / max(1.0 - gen_idle, 0.05),
        train_s_per_step=statistics.mean(busy),
        lengths=lengths,
        steps_per_s=len(walls) / sum(walls),
        staleness_mean=statistics.mean(row["buffer/staleness/mean"] for row in steady),
        learner_idle_frac=statistics.mean(row.get("timing/learner/idle_frac", 0.0) for row in steady),
        generator_idle_frac=gen_idle,
        steps=len(rows),
        groups_per_step=groups_per_step,
        n=statistics.mode(len(group) for group in lengths),
        filter_frac=filter_frac,
    )


def filtered_fraction(rows: list, groups_per_step: int) -> float:
    """The share of the groups sampled over `rows` that dynamic sampling dropped. `generator/filtered_groups` is
    the fleet's running total (a generator's count since it started), logged when a report carries it; trained
    groups are the steps' batches."""
    totals = [row["generator/filtered_groups"] for row in rows if "generator/filtered_groups" in row]
    if len(totals) < 2:
        return 0.0
    filtered = sum(max(later - earlier, 0.0) for earlier, later in zip(totals, totals[1:]))  # a restart resets one
    trained = (len(rows) - 1) * groups_per_step
    return filtered / (filtered + trained) if filtered + trained else 0.0


def _generator_count(job_dir: str) -> int:
    path = os.path.join(job_dir, "summary.json")
    if os.path.isfile(path):
        with open(path) as handle:
            generators = json.load(handle).get("generators") or {}
        if generators:
            return len(generators)
    return 1


def empirical_lengths(groups: list):
    """A sampler of a group's completion lengths, drawn from the measured groups: a whole group when it has the
    size asked for (the lengths of one prompt's samples go together, which sets how long the group waits for its
    longest), else each length from the pool."""
    pool = [length for group in groups for length in group]

    def sample(rng, n: int) -> list:
        group = groups[rng.randrange(len(groups))]
        return list(group) if len(group) == n else [pool[rng.randrange(len(pool))] for _ in range(n)]

    return sample


def lognormal_lengths(mean: float, cv: float):
    """A sampler of n independent lognormal completion lengths with this mean and coefficient of variation."""
    import math

    sigma = math.sqrt(math.log(1 + cv * cv))
    mu = math.log(mean) - sigma * sigma / 2
    return lambda rng, n: [rng.lognormvariate(mu, sigma) for _ in range(n)]
