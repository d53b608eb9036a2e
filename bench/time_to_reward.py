"""Time to reward on the demo: what asynchrony is for. It reports; it does not assert.

For every seed, one after another in this job: `asyncrl run` with the demo recipe at each η in `--etas` (η = 0 is
asyncrl's own synchronous mode), each `--variant` (a name and overrides, e.g. another correction), and TRL's
`GRPOTrainer` with the same settings (bench/trl_grpo.py; `--no-trl` leaves it out). The seed moves the learner's
and the generators' seeds and TRL's, never the warm start: every run starts from the same cached demo model.

Per run, from its own progress.jsonl (one line per step; the reward is that of everything the policy sampled,
`row_reward`):
- time to target: wall time from the first step until the mean reward of the last `--window` steps first reaches
  `--target` (None if it never does);
- reward at budget: that rolling mean at the last step within `--budget-s` of the first step;
- final reward: the mean of the last `--final-steps` steps;
- samples/s between the first and the last step; the learner's idle fraction (waiting for batches) and the
  generators' (neither sampling nor loading weights); staleness; IS-weight mean and max where the correction has
  IS weights.
The table shows the median and the range over seeds; the JSON line has every run. Usage:
    python -m asyncrl.bench.time_to_reward [--seeds 0 1 2] [--etas 0 2 (none: variants only)] [--steps 500] [--target 0.6]
        [--variant NAME=key=value,key=value ...] [--no-trl] [overrides...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

IS_WEIGHT_KEYS = ("offpolicy/is_weight/mean", "offpolicy/is_weight/max")


def read_progress(job_dir: str) -> list:
    with open(os.path.join(job_dir, "progress.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def rolling_means(values: list, window: int) -> list:
    """Mean of the last `window` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def time_to_target(elapsed: list, rewards: list, target: float, window: int) -> float | None:
    """Seconds from the first step until the rolling mean first reaches `target`, counting only positions with a
    full window (a lucky first step is not "reached")."""
    for index, mean in enumerate(rolling_means(rewards, window)):
        if index + 1 >= window and mean >= target:
            return elapsed[index] - elapsed[0]
    return None


def reward_at_budget(elapsed: list, rewards: list, budget_s: float, window: int) -> float | None:
    means = rolling_means(rewards, window)
    within = [index for index, seconds in enumerate(elapsed) if seconds - elapsed[0] <= budget_s]
    return means[within[-1]] if within else None


def row_reward(row: dict) -> float:
    """The reward of what the policy sampled: `reward/sampled_mean` where the row has it (every group sampled since
    the previous step, buffer/sampled.py; the learner's `reward/mean` covers only the groups it trained on, and
    dynamic sampling drops the all-0 and all-1 ones), else `reward/mean` (rows written before asyncrl logged it)."""
    return row.get("reward/sampled_mean", row["reward/mean"])


def summarize(progress: list, samples_per_step: int, target: float, window: int, budget_s: float,
              final_steps: int) -> dict:
    """One run's numbers, from its per-step progress rows."""
    elapsed = [row["elapsed_s"] for row in progress]
    rewards = [row_reward(row) for row in progress]
    span = elapsed[-1] - elapsed[0]

    def mean_of(key):
        values = [row[key] for row in progress if key in row]
        return sum(values) / len(values) if values else None

    return {
        "steps": len(progress),
        "time_to_target_s": time_to_target(elapsed, rewards, target, window),
        "reward_at_budget": reward_at_budget(elapsed, rewards, budget_s, window),
        "reward_first": sum(rewards[:final_steps]) / len(rewards[:final_steps]),
        "reward_final": sum(rewards[-final_steps:]) / len(rewards[-final_steps:]),
        "samples_per_s": samples_per_step * (len(progress) - 1) / span if span > 0 else None,
        "step_wall_s": span / max(len(progress) - 1, 1),
        "learner_idle_frac": mean_of("timing/learner/idle_frac"),
        "generator_idle_frac": mean_of("timing/generator/idle_frac"),
        "staleness_mean": mean_of("buffer/staleness/mean"),
        "is_weight_mean": mean_of(IS_WEIGHT_KEYS[0]),
        "is_weight_max": max((row[IS_WEIGHT_KEYS[1]] for row in progress if IS_WEIGHT_KEYS[1] in row), default=None),
    }


def run_asyncrl(job_dir: str, seed: int, steps: int, overrides: list) -> None:
    env = {**os.environ, "ASYNCRL_JOB_DIR": job_dir, "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI",
                                                 f"sqlite:///{os.path.dirname(job_dir)}/mlflow.db")}
    # generator reports (idle fraction, the sampled reward) reach the learner's rows every second, unless overridden;
    # no evaluation rounds (TRL's runs evaluate nothing either), unless overridden
    command = [sys.executable, "-m", "asyncrl.launch.cli", "run", "generator.log_every_s=1", "eval.every_steps=0",
               "eval.before_train=false", *overrides,
               f"learner.total_steps={steps}", f"learner.seed={seed}", f"generator.seed={seed}",
               "telemetry.progress=false"]
    check(subprocess.run(command, env=env, capture_output=True, text=True), job_dir)


def run_trl(job_dir: str, seed: int, steps: int, overrides: list) -> None:
    command = [sys.executable, "-m", "asyncrl.bench.trl_grpo", "--job-dir", job_dir, "--seed", str(seed),
               "--steps", str(steps), *overrides]
    check(subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True),
          job_dir)


def check(done: subprocess.CompletedProcess, job_dir: str) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"the run in {job_dir} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")


def parse_variant(text: str) -> tuple[str, list]:
    """NAME=key=value,key=value -> (NAME, [key=value, ...])."""
    name, _, overrides = text.partition("=")
    if not name or not overrides:
        raise argparse.ArgumentTypeError(f"--variant wants NAME=key=value[,key=value...], got {text!r}")
    return name, overrides.split(",")


def spread(values: list) -> str:
    """median [min, max]; a run that never reached the target counts as later than any that did."""
    reached = [value for value in values if value is not None]
    if not values or not reached:
        return "-"
    if len(reached) < len(values):
        return f"{len(reached)}/{len(values)} reached"
    return f"{median_or_none(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def median_or_none(values: list):
    """The median, a missing value (a target never reached) counting as later than any other; None if the median
    itself is missing."""
    ordered = sorted(values, key=lambda value: (value is None, value or 0.0))
    middle = len(ordered) // 2
    picks = ordered[middle:middle + 1] if len(ordered) % 2 else ordered[middle - 1:middle + 1]
    return None if not picks or None in picks else sum(picks) / len(picks)


COLUMNS = (("time_to_target_s", "time to target s"), ("reward_at_budget", "reward at budget"),
           ("reward_final", "final reward"), ("samples_per_s", "samples/s"), ("learner_idle_frac", "learner idle"),
           ("generator_idle_frac", "gen idle"), ("staleness_mean", "staleness"), ("is_weight_mean", "IS mean"),
           ("is_weight_max", "IS max"))


def print_table(configs: dict) -> None:
    print("| run | " + " | ".join(label for _, label in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for name, runs in configs.items():
        cells = [spread([run[key] for run in runs]) for key, _ in COLUMNS]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--etas", type=int, nargs="*", default=[0, 2])
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        help="NAME=key=value,... : one more asyncrl run per seed with these overrides")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--final-steps", type=int, default=50)
    parser.add_argument("--no-trl", action="store_true", help="leave TRL out (it is the `bench` extra)")
    parser.add_argument("--keep", help="keep every run's job directory under this path")
    parser.add_argument("overrides", nargs="*", help="overrides for every run, asyncrl and TRL alike")
    args = parser.parse_args(argv)
    from asyncrl.configs import load_config

    cfg = load_config("demo_cpu.yaml", args.overrides)
    samples_per_step = cfg.buffer.groups_per_step * cfg.rollout.n
    plan = [(f"asyncrl eta={eta}", [f"buffer.max_staleness={eta}"]) for eta in args.etas]
    plan += [(f"asyncrl {name}", overrides) for name, overrides in args.variant]
    if not args.no_trl:
        plan.append(("TRL GRPOTrainer", None))
    workdir = args.keep or tempfile.mkdtemp(prefix="asyncrl-ttr-")
    configs: dict = {name: [] for name, _ in plan}
    for seed in args.seeds:  # seeds outermost: a drift in the machine's speed hits every config alike
        for index, (name, extra) in enumerate(plan):
            job_dir = os.path.join(workdir, f"seed{seed}-{index}")
            if extra is None:
                run_trl(job_dir, seed, args.steps, args.overrides)
            else:
                run_asyncrl(job_dir, seed, args.steps, [*args.overrides, *extra])
            run = summarize(read_progress(job_dir), samples_per_step, args.target, args.window, args.budget_s,
                            args.final_steps)
            configs[name].append({"seed": seed, **run})
            print(f"{name} seed {seed}: {json.dumps(run)}", file=sys.stderr, flush=True)
    print(f"target {args.target} (mean of {args.window} steps), budget {args.budget_s:.0f} s, final = last "
          f"{args.final_steps} of {args.steps} steps; median [min, max] over seeds {args.seeds}")
    print_table(configs)
    medians = {name: {key: median_or_none([run[key] for run in runs]) for key, _ in COLUMNS}
               for name, runs in configs.items()}
    result = {"bench": "time_to_reward", "target": args.target, "steps": args.steps, "seeds": args.seeds,
              "medians": medians, "runs": configs}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
