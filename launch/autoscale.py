"""The autoscaler's policy: how many generators a job should have, from what its learner records every step.

`asyncrl ray --autoscale MIN:MAX` runs it in the fleet actor, which reads the learner's progress.jsonl rows every
`interval_s` seconds, calls `Autoscaler.observe`, and starts or stops generators when a `Decision` comes back.
This module decides only; it starts nothing and imports no Ray, so it is tested on scripted jobs.

What it reads (telemetry/run_record.py writes each row, buffer/fleet_stats.py sums the generators' reports into it):
- `timing/learner/idle_frac`: the share of a step the learner waited for its batch. Above `learner_idle_high`
  the generators do not keep up: grow.
- `timing/generator/idle_frac`: the fleet's mean share of time with no group running, i.e. waiting between
  admissions. Above `generator_idle_high`, with a learner that does not wait, the generators outrun it: shrink.
- `buffer/staleness/max` against the bound (`offpolicy/staleness/hist/<η>` names η): the share of steps that
  trained a group as old as allowed. With a waiting learner it says the admission window is full of slow groups
  (grow); with busy generators idle between admissions, that they run as far ahead as admission lets them.
  Reported, not a trigger: the two idle fractions already say which side waits.
- `perf/generator/tokens_per_s`, for the log: one generator's busy rate and the learner's consumption.

How far it moves: `asyncrl plan`'s balance, the utilization ρ of planner/closed_form.py (the fleet's rollout
throughput over the trainer's). One generator delivers busy tokens/s = fleet tokens/s / (g · (1 - generator
idle)); the learner, while it trains, takes fleet tokens/s / (1 - learner idle). The fleet that balances them has
g* = g · (1 - generator idle) / (1 - learner idle) generators; the target keeps `headroom` over it (so noise does not
starve the learner), rounded up, moved at most `max_step` per decision, kept within [min, max]. A target equal to
the current count holds, so a fleet at the model's size stays there: the thresholds only add a dead band.

When both sides wait (the learner for batches, generators for admission), the admission window (buffer.max_staleness,
buffer.admission_lead) limits the job, not the fleet: more generators would wait too, so it holds and says so.
"""
import math
import re
from dataclasses import dataclass

LEARNER_IDLE = "timing/learner/idle_frac"
GENERATOR_IDLE = "timing/generator/idle_frac"
FLEET_TOKENS = "perf/generator/tokens_per_s"
STALENESS_MEAN = "buffer/staleness/mean"
STALENESS_MAX = "buffer/staleness/max"
DROPPED_STALE = "buffer/dropped/stale"
STALENESS_HIST = "offpolicy/staleness/hist/"
MIN_LEARNER_BUSY = 0.05
"""The learner's busy share is floored here (as planner/from_run.py floors the generators'): a learner that waited
for nearly every second of the window says "many more", and max_step bounds how many."""


@dataclass
class AutoscalePolicy:
    min_generators: int = 1
    """Never fewer generators than this (>= 1: a job without generators never trains)."""
    max_generators: int = 8
    """Never more generators than this."""
    interval_s: float = 30.0
    """Seconds between the fleet actor's calls to observe()."""
    window_steps: int = 5
    """Progress rows a decision reads: the newest, and only steps recorded after the last change counts."""
    cooldown_s: float = 60.0
    """Seconds after a change during which no other is made and the steps recorded are not counted: new generators
    start their engines and deliver first. Set it above the engine's start time."""
    warmup_steps: int = 2
    """The job's first steps never count: they wait for the engines to start, not for a too small fleet."""
    learner_idle_high: float = 0.10
    """Grow when the learner waited for its batch more than this share of its steps' wall time."""
    generator_idle_high: float = 0.25
    """Shrink when generators were idle (waiting for admission) more than this share of the time and the learner
    did not wait."""
    headroom: float = 0.10
    """Spare capacity the target keeps over the model's balance point, as a share of it."""
    max_step: int = 2
    """At most this many generators added or removed by one decision."""
    max_staleness: int | None = None
    """The job's buffer.max_staleness, for the share of steps at the bound; None: read from the rows'
    offpolicy/staleness/hist/<k> keys."""

    def __post_init__(self):
        if self.min_generators < 1:
            raise ValueError(f"autoscale min_generators must be >= 1 (a job needs a generator), got "
                             f"{self.min_generators}")
        if self.max_generators < self.min_generators:
            raise ValueError(f"autoscale max_generators must be >= min_generators ({self.min_generators}), got "
                             f"{self.max_generators}")
        if not self.interval_s > 0:
            raise ValueError(f"autoscale interval_s must be > 0, got {self.interval_s}")
        for name in ("cooldown_s", "headroom"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"autoscale {name} must be >= 0, got {getattr(self, name)}")
        for name in ("window_steps", "max_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"autoscale {name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"autoscale warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("learner_idle_high", "generator_idle_high"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"autoscale {name} must be in (0, 1), got {getattr(self, name)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"autoscale max_staleness must be >= 0 or None, got {self.max_staleness}")


def parse_autoscale(text: str, interval_s: float = 30.0) -> AutoscalePolicy:
    """`--autoscale MIN:MAX` ("1:8") as a policy with the default thresholds."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"--autoscale takes MIN:MAX generators as two whole numbers, e.g. 1:8; got {text!r}")
    low, high = int(match.group(1)), int(match.group(2))
    if low < 1:
        raise ValueError(f"--autoscale MIN must be >= 1 (a job needs a generator to train); got {text!r}")
    if high < low:
        raise ValueError(f"--autoscale MAX must be >= MIN; got {text!r}")
    return AutoscalePolicy(min_generators=low, max_generators=high, interval_s=interval_s)


@dataclass
class FleetSignal:
    """What the window of progress rows measured: means over its steps (None where no row carried the field)."""
    first_step: int
    last_step: int
    steps: int
    learner_idle_frac: float
    generator_idle_frac: float | None = None
    fleet_tokens_per_s: float | None = None
    staleness_mean: float | None = None
    max_staleness: int | None = None
    at_bound_frac: float | None = None
    """The share of steps whose oldest trained group was at max_staleness."""
    dropped_stale: float = 0.0
    """Groups dropped as too old over the window."""

    def metrics(self) -> dict:
        """autoscale/<name> for MLflow: every measured number."""
        names = ("learner_idle_frac", "generator_idle_frac", "fleet_tokens_per_s", "staleness_mean", "at_bound_frac",
                 "dropped_stale")
        return {f"autoscale/{name}": float(getattr(self, name)) for name in names if getattr(self, name) is not None}


@dataclass
class Decision:
    target: int
    """The generator count to reach."""
    reason: str
    """One line for the job's log, with the numbers that decided it."""
    signal: FleetSignal | None
    """What was measured; None for a count brought back within [min, max], which reads nothing."""
    current: int = 0
    """The count the decision was made at."""

    def metrics(self) -> dict:
        """autoscale/generators (the target) and the signal's numbers, for MLflow at the step it was made."""
        return {"autoscale/generators": float(self.target), **(self.signal.metrics() if self.signal else {})}


def step_of(row) -> int | None:
    """A row's step: a whole number >= 0 (a float like 12.0 too), else None."""
    step = row.get("step") if isinstance(row, dict) else None
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return int(step) if step >= 0 and step == int(step) else None


def number_of(row: dict, key: str, high: float = math.inf) -> float | None:
    """row[key] when it is a finite real number in [0, high], else None: a row is a file's line, and a missing,
    NaN or text value says nothing about the fleet."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0.0 <= value <= high else None  # NaN fails both comparisons


def fresh_rows(records: list, after_step: int) -> list:
    """The usable rows of steps after `after_step`, in step order; a step recorded twice (a resumed learner)
    counts its last row. Usable: a dict with a step and a learner idle fraction in [0, 1]."""
    latest = {}
    for row in records:
        step = step_of(row)
        if step is not None and step > after_step and number_of(row, LEARNER_IDLE, 1.0) is not None:
            latest[step] = row
    return [latest[step] for step in sorted(latest)]


def latest_step(records: list) -> int:
    """The newest step any row names (-1 for none)."""
    return max((step for step in map(step_of, records) if step is not None), default=-1)


def staleness_bound(rows: list) -> int | None:
    """η from the rows' offpolicy/staleness/hist/<k> keys (k = 0..η, learner/step_metrics.py), None without them."""
    ks = [int(key[len(STALENESS_HIST):]) for row in rows for key in row
          if isinstance(key, str) and key.startswith(STALENESS_HIST) and key[len(STALENESS_HIST):].isdigit()]
    return max(ks) if ks else None


def _mean(values: list) -> float | None:
    values = [value for value in values if value is not None]
    return sum(values) / len(values) if values else None


def measure_window(rows: list, max_staleness: int | None = None) -> FleetSignal:
    """The signal of `rows` (fresh_rows' output, non-empty). `max_staleness` None: read from the rows."""
    bound = staleness_bound(rows) if max_staleness is None else max_staleness
    maxima = [number_of(row, STALENESS_MAX) for row in rows]
    known = [value for value in maxima if value is not None]
    return FleetSignal(
        first_step=step_of(rows[0]), last_step=step_of(rows[-1]), steps=len(rows),
        learner_idle_frac=_mean([number_of(row, LEARNER_IDLE, 1.0) for row in rows]),
        generator_idle_frac=_mean([number_of(row, GENERATOR_IDLE, 1.0) for row in rows]),
        fleet_tokens_per_s=_mean([number_of(row, FLEET_TOKENS) for row in rows]),
        staleness_mean=_mean([number_of(row, STALENESS_MEAN) for row in rows]),
        max_staleness=bound,
        at_bound_frac=(sum(value >= bound for value in known) / len(known) if known and bound is not None else None),
        dropped_stale=sum(value for value in (number_of(row, DROPPED_STALE) for row in rows) if value is not None),
    )


def balanced_generators(signal: FleetSignal, current: int) -> float:
    """g* = g · (1 - generator idle) / (1 - learner idle): the fleet whose busy rate matches what the learner takes
    while it trains (module docstring). Unreported generator idleness counts as none: fully busy generators are the
    reading that grows the least."""
    busy = 1.0 - (signal.generator_idle_frac or 0.0)
    return current * busy / max(1.0 - signal.learner_idle_frac, MIN_LEARNER_BUSY)


def describe_signal(signal: FleetSignal, current: int, balanced: float) -> str:
    """The measured numbers and the model's balance, for a decision's reason."""
    parts = [f"steps {signal.first_step}-{signal.last_step}: learner waited {signal.learner_idle_frac:.0%}"]
    if signal.generator_idle_frac is not None:
        parts.append(f"generators idle {signal.generator_idle_frac:.0%}")
    if signal.at_bound_frac is not None:
        parts.append(f"staleness at its bound {signal.max_staleness} in {signal.at_bound_frac:.0%} of steps")
    busy = 1.0 - (signal.generator_idle_frac or 0.0)
    if signal.fleet_tokens_per_s and busy > 0:
        one = signal.fleet_tokens_per_s / current / busy
        need = signal.fleet_tokens_per_s / max(1.0 - signal.learner_idle_frac, MIN_LEARNER_BUSY)
        parts.append(f"one generator makes {one:.0f} busy tok/s, the learner takes {need:.0f} tok/s")
    return "; ".join(parts) + f": {balanced:.2f} generators balance it"


def size_fleet(signal: FleetSignal, current: int, policy: AutoscalePolicy) -> tuple[int, str]:
    """(target, reason): the target equals `current` when it holds."""
    balanced = balanced_generators(signal, current)
    wanted = math.ceil(balanced * (1.0 + policy.headroom) - 1e-9)
    numbers = describe_signal(signal, current, balanced)
    learner_waits = signal.learner_idle_frac > policy.learner_idle_high
    generators_wait = (signal.generator_idle_frac is not None
                       and signal.generator_idle_frac > policy.generator_idle_high)
    if learner_waits and generators_wait:
        return current, (f"hold at {current}: both sides wait ({numbers}); the admission window "
                         f"(buffer.max_staleness, buffer.admission_lead) limits the job, not the fleet")
    if learner_waits and wanted > current:
        target = min(wanted, current + policy.max_step, policy.max_generators)
        if target > current:
            return target, (f"grow {current} -> {target} generators ({numbers}; {wanted} with "
                            f"{policy.headroom:.0%} headroom, at most +{policy.max_step} a decision, "
                            f"max {policy.max_generators})")
        return current, f"hold at {current}, the maximum ({numbers})"
    if generators_wait and not learner_waits and wanted < current:
        target = max(wanted, current - policy.max_step, policy.min_generators)
        if target < current:
            return target, (f"shrink {current} -> {target} generators ({numbers}; {wanted} with "
                            f"{policy.headroom:.0%} headroom, at most -{policy.max_step} a decision, "
                            f"min {policy.min_generators})")
        return current, f"hold at {current}, the minimum ({numbers})"
    return current, f"hold at {current} ({numbers})"


class Autoscaler:
    """Decides, each time the fleet actor calls observe(), whether the fleet should change size.

    A change is a decision it returned or any other change of the live count (a user's `asyncrl ray scale`, a
    generator that died and was not restarted): after one it waits `cooldown_s`, and only steps recorded after the
    cooldown count, so the new fleet is judged on its own steps. `held` says why the last call returned None."""

    def __init__(self, policy: AutoscalePolicy):
        self.policy = policy
        self.held = ""
        self._counted_after = policy.warmup_steps  # steps up to this one never count
        self._cooldown_until = -math.inf
        self._current: int | None = None  # the live count at the last call
        self._expected: int | None = None  # the target of the last decision, until the fleet reaches it

    def observe(self, records: list, current: int, now: float) -> Decision | None:
        """records: progress.jsonl rows (dicts) seen so far, or their recent tail; current: the live generator
        count; now: time.monotonic(). A Decision when the target differs from `current`, else None (`held`)."""
        policy = self.policy
        if self._current is not None and current != self._current and current != self._expected:
            self._mark_change(records, now)
        self._current = current
        if current == self._expected:
            self._expected = None
        if now < self._cooldown_until:
            self._counted_after = max(self._counted_after, latest_step(records))
            return self._hold(f"cooldown: {self._cooldown_until - now:.0f} s more after the last change")
        if not policy.min_generators <= current <= policy.max_generators:
            target = min(max(current, policy.min_generators), policy.max_generators)
            return self._decide(records, now, Decision(target, f"{current} generators is outside --autoscale "
                                                       f"{policy.min_generators}:{policy.max_generators}: "
                                                       f"{current} -> {target}", None, current))
        rows = fresh_rows(records, self._counted_after)
        if len(rows) < policy.window_steps:
            return self._hold(f"{len(rows)} of {policy.window_steps} steps recorded after step "
                              f"{self._counted_after}")
        signal = measure_window(rows[-policy.window_steps:], policy.max_staleness)
        target, reason = size_fleet(signal, current, policy)
        if target == current:
            return self._hold(reason)
        return self._decide(records, now, Decision(target, reason, signal, current))

    def _hold(self, reason: str) -> None:
        self.held = reason
        return None

    def _decide(self, records: list, now: float, decision: Decision) -> Decision:
        self._mark_change(records, now)
        self._expected = decision.target
        return decision

    def _mark_change(self, records: list, now: float) -> None:
        self._cooldown_until = now + self.policy.cooldown_s
        self._counted_after = max(self._counted_after, latest_step(records))
