"""The autoscaler's policy (launch/autoscale.py) against scripted jobs whose idle fractions are known.

The scripted job: each generator produces r groups/s while busy, the learner trains c groups/s, B groups a step.
A step takes B / min(g·r, c) seconds; the learner waits max(0, 1 - g·r/c) of it and the generators idle
max(0, 1 - c/(g·r)) of theirs, and the groups it trains are as old as allowed when generators outrun the learner.
So the fleet that balances it has c/r generators, and the autoscaler's target is ceil(c/r · (1 + headroom)).
It writes progress.jsonl rows with the learner's real field names (telemetry/run_record.py, buffer/fleet_stats.py,
learner/step_metrics.py). New generators deliver `start_s` after they are asked for.
"""
import math
import os
import random

import pytest

from asyncrl.buffer.fleet_stats import fleet_metrics
from asyncrl.launch import autoscale
from asyncrl.launch.autoscale import (AutoscalePolicy, Autoscaler, Decision, FleetSignal, balanced_generators,
                                      fresh_rows, measure_window, parse_autoscale, size_fleet)
from asyncrl.launch.plan import enough_generators
from asyncrl.planner.from_run import lognormal_lengths
from asyncrl.planner.simulate import Fleet, Learner, Queue, simulate
from asyncrl.telemetry.run_record import batch_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ScriptedJob:
    def __init__(self, r: float, c: float, generators: int, groups_per_step: int = 4, max_staleness: int = 1,
                 tokens_per_group: float = 1000.0, start_s: float = 0.0, noise: float = 0.0, seed: int = 0):
        self.r, self.c, self.B, self.eta = r, c, groups_per_step, max_staleness
        self.tokens_per_group, self.start_s, self.noise = tokens_per_group, start_s, noise
        self.rng = random.Random(seed)
        self.generators = generators  # delivering now
        self.pending: list = []  # (time it takes effect, count)
        self.clock = 0.0
        self.records: list = []

    def scale(self, generators: int) -> None:
        """Fewer take effect at once (stopped between groups); more once their engines started."""
        delay = self.start_s if generators > self.generators else 0.0
        self.pending.append((self.clock + delay, generators))

    def run(self, seconds: float) -> None:
        until = self.clock + seconds
        while True:
            for when, count in list(self.pending):
                if when <= self.clock:
                    self.generators = count
                    self.pending.remove((when, count))
            wall = self.step_s()
            if self.clock + wall > until:
                return
            self.clock += wall
            self.records.append(self.row(len(self.records) + 1, wall))

    def step_s(self) -> float:
        return self.B / min(self.generators * self.r, self.c)

    def measured(self) -> tuple:
        """(learner idle, generator idle, fleet tokens/s, staleness mean, staleness max) of the fleet now."""
        supply = self.generators * self.r
        jitter = self.rng.uniform(-self.noise, self.noise)
        learner_idle = min(max(1 - supply / self.c + jitter, 0.0), 1.0)
        generator_idle = min(max(1 - self.c / supply + jitter, 0.0), 1.0)
        staleness = float(self.eta if supply > self.c else max(self.eta - 1, 0))
        return learner_idle, generator_idle, min(supply, self.c) * self.tokens_per_group, staleness, staleness

    def row(self, step: int, wall: float) -> dict:
        learner_idle, generator_idle, tokens_per_s, staleness_mean, staleness_max = self.measured()
        return {"step": step, "total": 10_000, "elapsed_s": self.clock, "reward/mean": 0.5,
                "timing/learner/wait_for_batch_s": learner_idle * wall, "timing/learner/idle_frac": learner_idle,
                "timing/generator/idle_frac": generator_idle, "perf/generator/tokens_per_s": tokens_per_s,
                "buffer/staleness/mean": staleness_mean, "buffer/staleness/max": staleness_max,
                "buffer/dropped/stale": 0.0,
                **{f"offpolicy/staleness/hist/{k}": float(k == round(staleness_mean)) for k in range(self.eta + 1)}}


class PlannedJob(ScriptedJob):
    """A job whose every fleet size behaves as `asyncrl plan`'s simulation of it (planner/simulate.py: generators
    sharing their engine among their groups, asyncrl's admission rule, the learner's fixed step time)."""

    def __init__(self, generators: int, plans: dict, max_staleness: int):
        super().__init__(r=1.0, c=1.0, generators=generators, groups_per_step=8, max_staleness=max_staleness)
        self.plans = plans

    def step_s(self) -> float:
        return 1.0 / self.plans[self.generators].steps_per_s

    def measured(self) -> tuple:
        plan = self.plans[self.generators]  # its generator idle can read -1e-16
        return (plan.learner_idle_frac, min(max(plan.generator_idle_frac, 0.0), 1.0), plan.tokens_per_s,
                plan.staleness_mean, float(max(plan.staleness)))


def drive(job: ScriptedJob, scaler: Autoscaler, seconds: float) -> list:
    """The fleet actor's loop: every interval, observe the rows so far and apply a decision. (time, Decision)."""
    decisions = []
    while job.clock < seconds:
        job.run(scaler.policy.interval_s)
        live = job.pending[-1][1] if job.pending else job.generators  # the fleet actor counts started actors
        decision = scaler.observe(job.records, live, job.clock)
        if decision is not None:
            decisions.append((job.clock, decision))
            job.scale(decision.target)
    return decisions


def sizes(decisions: list) -> list:
    return [decision.target for _, decision in decisions]


def test_a_waiting_learner_grows_the_fleet_to_the_models_size_and_it_stays_there():
    # c / r = 2.5 generators balance it; with 10% headroom the target is 3
    job = ScriptedJob(r=1.0, c=2.5, generators=1)
    decisions = drive(job, Autoscaler(AutoscalePolicy()), seconds=1800)
    assert sizes(decisions) == [3]
    first = decisions[0][1]
    assert first.current == 1 and first.signal.learner_idle_frac == pytest.approx(0.6)
    assert "grow 1 -> 3" in first.reason and "learner waited 60%" in first.reason and "2.50 generators" in first.reason
    assert "one generator makes 1000 busy tok/s, the learner takes 2500 tok/s" in first.reason


def test_idle_generators_shrink_the_fleet_a_bounded_step_at_a_time_to_the_same_size():
    job = ScriptedJob(r=1.0, c=2.5, generators=8)
    decisions = drive(job, Autoscaler(AutoscalePolicy()), seconds=1800)
    assert sizes(decisions) == [6, 4, 3]  # max_step 2 a decision, then the model's 3
    assert all("shrink" in decision.reason for _, decision in decisions)
    assert decisions[0][1].signal.generator_idle_frac == pytest.approx(1 - 2.5 / 8)
    assert decisions[0][1].signal.at_bound_frac == 1.0  # generators ahead: the groups are as old as allowed


@pytest.mark.parametrize("start, c_over_r", [(1, 5.3), (8, 5.3), (1, 1.7), (6, 0.6), (2, 3.9)])
def test_the_fleet_settles_without_oscillating_where_neither_side_waits_much(start, c_over_r):
    """Noisy idle fractions (±3%): after it settles, no decision in the next 50 minutes. It settles at the model's
    size ceil(c/r · 1.1), or short of it inside the dead band: a climb bounded by max_step can stop where the learner
    waits less than learner_idle_high (1 -> 3 -> 5 for c/r = 5.3, the learner waiting 6%)."""
    policy = AutoscalePolicy(min_generators=1, max_generators=8)
    job = ScriptedJob(r=1.0, c=c_over_r, generators=start, noise=0.03, seed=start)
    scaler = Autoscaler(policy)
    drive(job, scaler, seconds=1200)
    settled = job.generators
    assert drive(job, scaler, seconds=3000) == []
    model = math.ceil(c_over_r * (1 + policy.headroom))
    assert settled == model or (settled < model and 1 - settled / c_over_r <= policy.learner_idle_high)
    assert 1 - c_over_r / settled <= policy.generator_idle_high or settled == policy.min_generators


@pytest.mark.parametrize("train_s, max_staleness", [(1.0, 2), (1.5, 2), (2.0, 1), (0.5, 2)])
def test_on_the_planners_simulated_job_it_settles_where_asyncrl_plan_does(train_s, max_staleness):
    """`asyncrl plan` is the reference: on a job that behaves as the planner simulates it at each size (here the
    idle fractions are not the scripted job's formulas: admission holds generators back, a shared engine slows a
    generator's groups), the autoscaler ends, from 1 and from 8 generators, within one generator of the fewest
    that reach 95% of the best planned throughput (launch/plan.py::enough_generators), at 90% of it or better."""
    plans = {size: simulate(Fleet(generators=size, slots=4, n=4, gen_tokens_per_s=200),
                            Learner(groups_per_step=8, max_staleness=max_staleness, train_s_per_step=train_s),
                            Queue(), lognormal_lengths(20, 0.5), steps=80, warmup_steps=8) for size in range(1, 9)}
    rows = [{"generators": size, "eta": max_staleness, "steps_per_s": plan.steps_per_s}
            for size, plan in plans.items()]
    enough = enough_generators(rows)[max_staleness]
    best = max(row["steps_per_s"] for row in rows)
    for start in (1, 8):
        job = PlannedJob(start, plans, max_staleness)
        scaler = Autoscaler(AutoscalePolicy(min_generators=1, max_generators=8))
        drive(job, scaler, seconds=1800)
        settled = job.generators
        assert drive(job, scaler, seconds=3600) == []
        assert abs(settled - enough) <= 1 and plans[settled].steps_per_s >= 0.9 * best, (start, settled, enough)


def test_never_below_min_nor_above_max():
    starved = ScriptedJob(r=1.0, c=40.0, generators=2)
    assert sizes(drive(starved, Autoscaler(AutoscalePolicy(min_generators=2, max_generators=5)), 1800)) == [4, 5]
    idle = ScriptedJob(r=1.0, c=0.3, generators=6)
    assert sizes(drive(idle, Autoscaler(AutoscalePolicy(min_generators=1, max_generators=8)), 1800)) == [4, 2, 1]
    floor = ScriptedJob(r=1.0, c=0.3, generators=6)
    assert sizes(drive(floor, Autoscaler(AutoscalePolicy(min_generators=3, max_generators=8)), 1800)) == [4, 3]


def test_a_count_outside_the_bounds_is_brought_back_at_once():
    scaler = Autoscaler(AutoscalePolicy(min_generators=2, max_generators=4))
    decision = scaler.observe([], current=7, now=0.0)
    assert decision.target == 4 and decision.signal is None and "outside --autoscale 2:4" in decision.reason


def test_cooldown_spaces_decisions_and_the_steps_of_the_old_fleet_do_not_count():
    """New generators deliver 50 s after they are asked for; within the 60 s cooldown nothing is decided, and the
    steps the learner trained while they started (still waiting) are not read as 'grow again'."""
    policy = AutoscalePolicy(max_step=1, cooldown_s=60.0, interval_s=10.0)
    job = ScriptedJob(r=1.0, c=3.5, generators=1, start_s=50.0)
    decisions = drive(job, Autoscaler(policy), seconds=1800)
    assert sizes(decisions) == [2, 3, 4]
    times = [when for when, _ in decisions]
    assert all(later - earlier >= policy.cooldown_s for earlier, later in zip(times, times[1:]))
    for (when, decision), (_, previous) in zip(decisions[1:], decisions):
        # judged on the fleet the previous decision made: its learner idle is 1 - that fleet / 3.5
        assert decision.signal.learner_idle_frac == pytest.approx(1 - previous.target / 3.5)


def test_only_steps_after_the_last_change_count():
    policy = AutoscalePolicy(cooldown_s=0.0, warmup_steps=0)
    job = ScriptedJob(r=1.0, c=2.5, generators=1)
    job.run(60.0)
    scaler = Autoscaler(policy)
    decision = scaler.observe(job.records, 1, job.clock)
    assert decision.target == 3
    change_step = job.records[-1]["step"]
    assert scaler.observe(job.records, 3, job.clock + 100) is None  # the same rows again: nothing new
    assert "0 of 5 steps recorded after step" in scaler.held
    job.scale(3)
    job.run(60.0)
    assert scaler.observe(job.records, 3, job.clock) is None  # the new fleet is balanced
    assert "hold at 3" in scaler.held and f"steps {job.records[-5]['step']}-" in scaler.held
    assert job.records[-5]["step"] > change_step


def test_steps_recorded_during_the_cooldown_describe_the_starting_fleet_and_do_not_count():
    """The learner still waits while the new engines start: those steps, recorded in the cooldown, are not read
    as 'grow again' once it ends; the decision waits for window_steps steps after them."""
    def rows(first, last, idle):
        return [{"step": step, "timing/learner/idle_frac": idle, "timing/generator/idle_frac": 0.0}
                for step in range(first, last + 1)]

    scaler = Autoscaler(AutoscalePolicy(cooldown_s=60.0, warmup_steps=0))
    records = rows(1, 10, 0.6)
    assert scaler.observe(records, 1, 100.0).target == 3
    records += rows(11, 20, 0.6)  # the two new generators load their engines
    assert scaler.observe(records, 3, 130.0) is None and scaler.held.startswith("cooldown")
    records += rows(21, 23, 0.0)
    assert scaler.observe(records, 3, 170.0) is None and "3 of 5 steps recorded after step 20" in scaler.held
    records += rows(24, 25, 0.0)
    assert scaler.observe(records, 3, 200.0) is None and "hold at 3" in scaler.held


def test_the_target_keeps_headroom_over_the_balance():
    """c/r = 2.8: 3 generators would balance it exactly, so the target is ceil(2.8 · 1.1) = 4."""
    signal = FleetSignal(1, 5, 5, learner_idle_frac=1 - 2 / 2.8, generator_idle_frac=0.0)
    assert size_fleet(signal, 2, AutoscalePolicy())[0] == 4
    assert size_fleet(signal, 2, AutoscalePolicy(headroom=0.0))[0] == 3


def test_a_users_scale_counts_as_a_change():
    """`asyncrl ray scale` changed the count behind the autoscaler's back: it cools down and waits for new steps."""
    job = ScriptedJob(r=1.0, c=2.5, generators=1)
    job.run(60.0)
    scaler = Autoscaler(AutoscalePolicy())
    assert scaler.observe(job.records[:2], 1, 0.0) is None  # warmup steps only
    assert scaler.observe(job.records, 2, job.clock) is None
    assert scaler.held.startswith("cooldown")


def test_the_first_steps_of_the_job_are_not_counted():
    job = ScriptedJob(r=1.0, c=2.5, generators=1)
    job.run(21.0)  # steps 1..5, 4 s each
    scaler = Autoscaler(AutoscalePolicy(warmup_steps=2))
    assert scaler.observe(job.records, 1, job.clock) is None and "3 of 5 steps" in scaler.held


def test_both_sides_waiting_holds_and_names_the_admission_window():
    signal = FleetSignal(first_step=10, last_step=14, steps=5, learner_idle_frac=0.4, generator_idle_frac=0.5)
    target, reason = size_fleet(signal, 4, AutoscalePolicy())
    assert target == 4 and "both sides wait" in reason and "buffer.max_staleness" in reason


def test_the_balance_is_the_planners_utilization():
    """g · (1 - generator idle) / (1 - learner idle) is c / r on either side of the balance."""
    for g, c_over_r in ((2, 5.0), (6, 1.5)):
        li, gi = max(0.0, 1 - g / c_over_r), max(0.0, 1 - c_over_r / g)
        signal = FleetSignal(1, 5, 5, learner_idle_frac=li, generator_idle_frac=gi)
        assert balanced_generators(signal, g) == pytest.approx(c_over_r)


def test_rows_with_missing_or_garbage_fields_are_ignored_not_a_crash():
    good = ScriptedJob(r=1.0, c=2.5, generators=1)
    good.run(30.0)
    rows = list(good.records)
    garbage = [None, "step 3", [], {}, {"step": "7", "timing/learner/idle_frac": 0.9},
               {"step": 8, "timing/learner/idle_frac": float("nan")}, {"step": 9, "timing/learner/idle_frac": "0.9"},
               {"step": 10, "timing/learner/idle_frac": 1.7}, {"step": True, "timing/learner/idle_frac": 0.9},
               {"step": 11.5, "timing/learner/idle_frac": 0.9}, {"step": float("inf"), "timing/learner/idle_frac": 0.9},
               {"step": 12}]
    assert fresh_rows(garbage, -1) == []
    noisy = [dict(row, **{"timing/generator/idle_frac": "x", "perf/generator/tokens_per_s": float("nan"),
                          "buffer/staleness/max": None}) for row in rows]
    signal = measure_window(fresh_rows(noisy + garbage, 2)[-5:])
    assert signal.learner_idle_frac == pytest.approx(0.6) and signal.generator_idle_frac is None
    assert signal.fleet_tokens_per_s is None and signal.at_bound_frac is None and signal.max_staleness == 1
    decision = Autoscaler(AutoscalePolicy()).observe(noisy + garbage, 1, 100.0)
    assert decision.target == 3  # the learner's wait alone grows it, generators counted fully busy
    assert "one generator makes" not in decision.reason


def test_a_resumed_learner_s_repeated_steps_count_once():
    rows = [{"step": step, "timing/learner/idle_frac": 0.0} for step in range(1, 9)]
    rows += [{"step": step, "timing/learner/idle_frac": 0.5} for step in range(5, 9)]
    window = fresh_rows(rows, 0)
    assert [row["step"] for row in window] == list(range(1, 9))
    assert measure_window(window[-4:]).learner_idle_frac == 0.5


def test_signal_metrics_are_named_for_mlflow():
    signal = FleetSignal(1, 5, 5, learner_idle_frac=0.2, generator_idle_frac=None, dropped_stale=3.0)
    assert signal.metrics() == {"autoscale/learner_idle_frac": 0.2, "autoscale/dropped_stale": 3.0}
    assert Decision(3, "grow", signal, 1).metrics() == {"autoscale/generators": 3.0, **signal.metrics()}
    assert Decision(4, "outside", None, 7).metrics() == {"autoscale/generators": 4.0}


@pytest.mark.parametrize("text, expected", [("1:8", (1, 8)), (" 2 : 2 ", (2, 2)), ("3:16", (3, 16))])
def test_parse_autoscale(text, expected):
    policy = parse_autoscale(text, interval_s=15.0)
    assert (policy.min_generators, policy.max_generators, policy.interval_s) == (*expected, 15.0)


@pytest.mark.parametrize("text, message", [
    ("", "MIN:MAX"), ("8", "MIN:MAX"), ("1-8", "MIN:MAX"), ("a:b", "MIN:MAX"), ("1:8:2", "MIN:MAX"),
    ("-1:4", "MIN:MAX"), ("1.5:4", "MIN:MAX"), (None, "MIN:MAX"),
    ("0:4", "MIN must be >= 1"), ("5:2", "MAX must be >= MIN"),
])
def test_parse_autoscale_refuses_with_a_clear_message(text, message):
    with pytest.raises(ValueError, match=message):
        parse_autoscale(text)


@pytest.mark.parametrize("fields, key", [
    ({"min_generators": 0}, "min_generators"), ({"min_generators": 3, "max_generators": 2}, "max_generators"),
    ({"window_steps": 0}, "window_steps"), ({"max_step": 0}, "max_step"), ({"cooldown_s": -1}, "cooldown_s"),
    ({"learner_idle_high": 1.0}, "learner_idle_high"), ({"generator_idle_high": 0}, "generator_idle_high"),
    ({"warmup_steps": -1}, "warmup_steps"), ({"interval_s": 0}, "interval_s"), ({"headroom": float("nan")}, "headroom"),
])
def test_policy_refuses_bad_fields_by_name(fields, key):
    with pytest.raises(ValueError, match=key):
        AutoscalePolicy(**fields)


def test_the_fields_it_reads_are_the_ones_the_learner_writes():
    """A renamed metric would leave the autoscaler holding forever on 'no steps': each key it reads is one that
    progress.jsonl carries."""
    fleet = fleet_metrics([{"perf/generator/tokens_per_s": 10.0, "timing/generator/idle_frac": 0.5}])
    assert {autoscale.FLEET_TOKENS, autoscale.GENERATOR_IDLE} <= set(fleet)
    batch = batch_metrics([1, 2], {}, {})
    assert {autoscale.STALENESS_MEAN, autoscale.STALENESS_MAX, autoscale.DROPPED_STALE} <= set(batch)
    with open(os.path.join(REPO, "telemetry", "run_record.py")) as handle:
        assert f'metrics["{autoscale.LEARNER_IDLE}"]' in handle.read()
    with open(os.path.join(REPO, "algos", "metrics.py")) as handle:
        assert f'f"{autoscale.STALENESS_HIST}{{k}}"' in handle.read()
