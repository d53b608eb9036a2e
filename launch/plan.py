"""`asyncrl plan`: how many generators a learner needs, and what staleness and idle time each choice gives.

The planner (planner/simulate.py) simulates the job with asyncrl's own admission rule. Its inputs come from a
finished job (`--from-run JOB_DIR`: one generator's busy tokens/s, the learner's time per step, the completion
lengths, the batch shape) or from flags; the recipe and overrides give η, the admission lead and the generator's
in-flight groups. It prints a table over `--generators` × `--etas`, the fewest generators that reach 95% of the
best throughput at each η, and, with --from-run, the plan for the run's own setting beside what the run measured.
The last line is JSON.
"""
import json
import sys
from dataclasses import dataclass

from asyncrl.planner.from_run import Measured, empirical_lengths, lognormal_lengths, measure_run
from asyncrl.planner.simulate import MAX_FILTER_FRAC, Fleet, Learner, Queue, simulate

ENOUGH = 0.95
"""A fleet is big enough once its throughput is within 5% of the best in the sweep."""


def add_plan_arguments(cmd) -> None:
    cmd.add_argument("--from-run", default=None, metavar="JOB_DIR",
                     help="a finished job directory to measure the inputs from")
    cmd.add_argument("--generators", type=int, nargs="+", default=[1, 2, 4, 8], help="fleet sizes to plan")
    cmd.add_argument("--etas", type=int, nargs="+", default=None,
                     help="max staleness values to plan (default: the recipe's buffer.max_staleness)")
    cmd.add_argument("--steps", type=int, default=300, help="simulated learner steps per plan (default 300)")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--gen-tokens-per-s", type=float, default=None,
                     help="one generator's completion tokens/s while busy (without --from-run)")
    cmd.add_argument("--train-s", type=float, default=None,
                     help="the learner's seconds per step, wait excluded (without --from-run)")
    cmd.add_argument("--mean-len", type=float, default=None, help="mean completion length (without --from-run)")
    cmd.add_argument("--len-cv", type=float, default=0.5,
                     help="coefficient of variation of completion lengths, lognormal (without --from-run)")
    cmd.add_argument("--filter-frac", type=float, default=0.0,
                     help="the share of sampled groups dynamic sampling drops (without --from-run; default 0)")


@dataclass
class PlanInputs:
    """What a plan is simulated from: measured from a finished job (`inputs_of`) or given as flags."""
    gen_tokens_per_s: float
    train_s: float
    lengths: object
    """callable(rng, n) -> a group's completion lengths (planner/from_run.py's samplers)."""
    groups_per_step: int
    n: int
    filter_frac: float = 0.0
    """The share of sampled groups dynamic sampling drops."""


def inputs_of(measured: Measured) -> PlanInputs:
    return PlanInputs(measured.gen_tokens_per_s, measured.train_s_per_step, empirical_lengths(measured.lengths),
                      measured.groups_per_step, measured.n, measured.filter_frac)


def plan_inputs(cfg, args) -> tuple:
    """(measured run or None, PlanInputs)."""
    if args.from_run:
        measured = measure_run(args.from_run)
        return measured, inputs_of(measured)
    missing = [flag for flag, value in (("--gen-tokens-per-s", args.gen_tokens_per_s), ("--train-s", args.train_s),
                                        ("--mean-len", args.mean_len)) if value is None]
    if missing:
        raise ValueError(f"give --from-run JOB_DIR, or {', '.join(missing)}")
    if not 0.0 <= args.filter_frac <= MAX_FILTER_FRAC:
        raise ValueError(f"--filter-frac must be in [0, {MAX_FILTER_FRAC}], got {args.filter_frac}")
    return None, PlanInputs(args.gen_tokens_per_s, args.train_s, lognormal_lengths(args.mean_len, args.len_cv),
                            cfg.buffer.groups_per_step, cfg.rollout.n, args.filter_frac)


def plan_one(cfg, generators: int, eta: int, inputs: PlanInputs, steps: int, seed: int):
    """The job `cfg` with `generators` generators at max staleness `eta`."""
    lead = cfg.buffer.admission_lead
    fleet = Fleet(generators=generators, slots=cfg.generator.max_inflight_groups, n=inputs.n,
                  gen_tokens_per_s=inputs.gen_tokens_per_s, filter_frac=inputs.filter_frac)
    return simulate(fleet, Learner(groups_per_step=inputs.groups_per_step, max_staleness=eta,
                                   lead=None if lead is None else min(lead, eta), train_s_per_step=inputs.train_s),
                    Queue(), inputs.lengths, steps=steps, seed=seed, warmup_steps=max(steps // 10, 5))


def describe(measured: Measured) -> str:
    return (f"{measured.generators} generator(s) at {measured.gen_tokens_per_s:.0f} busy tokens/s each; "
            f"{measured.train_s_per_step:.3f} s per learner step; "
            f"{measured.groups_per_step} groups of {measured.n} per step, {measured.filter_frac:.0%} of sampled groups "
            f"filtered; {len(measured.lengths)} groups' lengths")


def row_of(generators: int, eta: int, result) -> dict:
    return {"generators": generators, "eta": eta, "steps_per_s": result.steps_per_s,
            "samples_per_s": result.samples_per_s, "staleness_mean": result.staleness_mean,
            "staleness_hist": {str(key): value for key, value in result.staleness_hist().items()},
            "learner_idle_frac": result.learner_idle_frac, "generator_idle_frac": result.generator_idle_frac}


def enough_generators(rows: list) -> dict:
    """η -> the fewest generators whose steps/s is within ENOUGH of the best planned at that η."""
    out = {}
    for eta in sorted({row["eta"] for row in rows}):
        at = [row for row in rows if row["eta"] == eta]
        best = max(row["steps_per_s"] for row in at)
        out[eta] = min(row["generators"] for row in at if row["steps_per_s"] >= ENOUGH * best)
    return out


def print_table(rows: list, say=print) -> None:
    say(f"{'generators':>10} {'eta':>4} {'steps/s':>8} {'samples/s':>10} {'staleness':>10} {'histogram':<24} "
        f"{'learner idle':>12} {'gen idle':>9}")
    for row in rows:
        hist = " ".join(f"{key}:{value:.2f}" for key, value in row["staleness_hist"].items())
        say(f"{row['generators']:>10} {row['eta']:>4} {row['steps_per_s']:>8.3f} {row['samples_per_s']:>10.1f} "
            f"{row['staleness_mean']:>10.2f} {hist:<24} {row['learner_idle_frac']:>12.2f} "
            f"{row['generator_idle_frac']:>9.2f}")


def staleness_error(planned: float, measured: float) -> float:
    """Relative, or the plain difference where the run measured 0 (η = 0)."""
    return (planned - measured) / measured if measured else planned - measured


def check_against_run(measured: Measured, planned: dict) -> dict:
    """The plan for the run's own fleet and η beside what the run measured; throughput's error is relative,
    staleness's too unless the run measured 0."""
    return {"measured_steps_per_s": measured.steps_per_s, "planned_steps_per_s": planned["steps_per_s"],
            "steps_per_s_error": planned["steps_per_s"] / measured.steps_per_s - 1,
            "measured_staleness_mean": measured.staleness_mean, "planned_staleness_mean": planned["staleness_mean"],
            "staleness_error": staleness_error(planned["staleness_mean"], measured.staleness_mean),
            "measured_learner_idle": measured.learner_idle_frac, "planned_learner_idle": planned["learner_idle_frac"],
            "measured_generator_idle": measured.generator_idle_frac,
            "planned_generator_idle": planned["generator_idle_frac"]}


def cmd_plan(cfg, args) -> int:
    """With --from-run, the run's own config (job_dir/config.yaml) under the overrides given here, so the check
    plans the run's setting."""
    import os

    from asyncrl.configs import load_config

    if args.from_run and os.path.isfile(os.path.join(args.from_run, "config.yaml")):
        cfg = load_config(os.path.join(args.from_run, "config.yaml"), list(args.overrides))
    try:
        measured, inputs = plan_inputs(cfg, args)
    except ValueError as err:
        print(f"asyncrl plan: {err}", file=sys.stderr)
        return 2
    etas = args.etas or [cfg.buffer.max_staleness]
    if min(args.generators) < 1 or min(etas) < 0 or args.steps < 1:
        print("asyncrl plan: --generators must be >= 1, --etas >= 0 and --steps >= 1", file=sys.stderr)
        return 2
    if measured is not None:
        print(f"measured from {args.from_run}: {describe(measured)}")
    rows = [row_of(g, eta, plan_one(cfg, g, eta, inputs, args.steps, args.seed))
            for eta in etas for g in args.generators]
    print_table(rows)
    enough = enough_generators(rows)
    for eta, generators in enough.items():
        print(f"at eta={eta} this learner needs {generators} generator(s): more add under {100 - ENOUGH * 100:.0f}% "
              f"throughput")
    out = {"plans": rows, "enough_generators": {str(eta): g for eta, g in enough.items()}}
    if measured is not None:
        own = row_of(measured.generators, cfg.buffer.max_staleness,
                     plan_one(cfg, measured.generators, cfg.buffer.max_staleness, inputs, args.steps, args.seed))
        out["check"] = check_against_run(measured, own)
        check = out["check"]
        print(f"check against the run (its own {measured.generators} generator(s), eta={cfg.buffer.max_staleness}):"
              f" steps/s planned {check['planned_steps_per_s']:.3f} vs measured {check['measured_steps_per_s']:.3f} "
              f"({check['steps_per_s_error']:+.0%}), staleness {check['planned_staleness_mean']:.2f} vs "
              f"{check['measured_staleness_mean']:.2f}")
    print(json.dumps(out))
    return 0
