"""Time to reward on the suite (bench/suite/tasks.py::SUITE): asyncrl's defaults against asyncrl at η = 0 and TRL,
on tasks nobody tuned them for, and every run's final model scored by one neutral judge. It reports; it does not
assert.

For every seed (outermost: a drift in the machine's speed hits every configuration alike), every task of `--tasks`
(built once, through the public path, under `--root`) and every configuration of `--configs`, one run after another
in this job, each with the task's recipe and overrides, then the command line's:
- `default`: `asyncrl run` with the task's recipe as it is;
- `eta0`: the same at η = 0 (buffer.max_staleness=0), asyncrl's synchronous mode, with learner.torch_threads and
  generator.torch_threads each set to their sum in the recipe: its phases never overlap, so each gets every core
  the asynchronous run splits between them (`sync_threads`);
- `trl`: TRL's `GRPOTrainer` with identical settings (bench/trl_grpo.py), on the same total of threads; "n/a" with
  the reason on a task it cannot run identically (multi-turn tools);
and one asyncrl run per `--etas` value and per `--variant` (a name and overrides, e.g. another correction). The
seed moves the learner's and the generators' seeds and TRL's, never the warm start: every run of a task starts from
its one cached model. asyncrl checkpoints only after its last step (learner.checkpoint_every = the steps), as TRL
saves only at its end, so neither pays for saves inside the timed span.

Per run, from its own progress.jsonl (one line per step):
- time to target: wall time from the first step until the mean reward of the last `--window` steps first reaches
  the target (the task's `target` unless `--target`; None if it never does). Comparable because both sides log the
  same quantity: the mean reward of everything the policy sampled for that step, before any filter (asyncrl's
  `reward/sampled_mean`, every group the generators sampled since the previous step, dynamic sampling's dropped
  groups included; TRL's logged `reward`, the mean over the step's whole batch, which it never filters), with the
  clock started at each framework's first step (so neither's start-up counts);
- reward at budget: that rolling mean at the last step within `--budget-s` of the first step (default: the shortest
  span of any run of the task, so every run is read at a time all of them reached);
- final reward: the mean of the last `--final-steps` steps;
- samples/s between the first and the last step; the learner's idle fraction (waiting for batches) and the
  generators' (neither sampling nor loading weights); staleness; IS-weight mean and max where the correction has
  IS weights;
- the judge (bench/judge.py) on the final model (asyncrl's checkpoint after its last step, TRL's `<job dir>/final`):
  held-out greedy mean reward and exact rate, and at T = 1 the mean reward and pass@k (`--judge-n` samples).
Per task one table (median [min, max] over seeds), then a summary table (per task: time to target of the default
over TRL's and over η = 0's, that last ratio split into the wall time of a step and the steps to the target, and
held-out greedy of each; the median of each over the tasks), then one JSON line with every run. Usage:
    python -m asyncrl.bench.time_to_reward [--tasks sort ...] [--root DIR] [--seeds 0 1 2]
        [--configs default eta0 trl] [--etas 2 ...] [--variant NAME=key=value,key=value ...] [--steps N]
        [--target R] [--judge-n 8] [--judge-prompts N] [--keep DIR] [overrides...]
"""
import argparse
import json
import os
import shutil
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


def target_index(rewards: list, target: float, window: int) -> int | None:
    """The first step whose rolling mean reaches `target`, counting only positions with a full window (a lucky
    first step is not "reached"); None if none does."""
    for index, mean in enumerate(rolling_means(rewards, window)):
        if index + 1 >= window and mean >= target:
            return index
    return None


def time_to_target(elapsed: list, rewards: list, target: float, window: int) -> float | None:
    """Seconds from the first step until the rolling mean first reaches `target` (target_index)."""
    index = target_index(rewards, target, window)
    return None if index is None else elapsed[index] - elapsed[0]


def steps_to_target(rewards: list, target: float, window: int) -> int | None:
    """How many steps the run trained until the rolling mean first reached `target`: time to target is these steps
    times the wall time of a step, so a ratio of two runs' times splits into how much each step cost and how much
    each step learned (an asynchronous run's steps are cheaper and may learn less: they train staler samples)."""
    index = target_index(rewards, target, window)
    return None if index is None else index + 1


def reward_at_budget(elapsed: list, rewards: list, budget_s: float, window: int) -> float | None:
    means = rolling_means(rewards, window)
    within = [index for index, seconds in enumerate(elapsed) if seconds - elapsed[0] <= budget_s]
    return means[within[-1]] if within else None


def row_reward(row: dict) -> float:
    """The reward of what the policy sampled: `reward/sampled_mean` where the row has it (every group sampled since
    the previous step, buffer/sampled.py; the learner's `reward/mean` covers only the groups it trained on, and
    dynamic sampling drops the all-0 and all-1 ones), else `reward/mean` (rows written before asyncrl logged it)."""
    return row["reward/sampled_mean"] if "reward/sampled_mean" in row else row["reward/mean"]


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


def run_asyncrl(job_dir: str, recipe: str, seed: int, steps: int, overrides: list) -> None:
    env = {**os.environ, "ASYNCRL_JOB_DIR": job_dir, "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI",
                                                 f"sqlite:///{os.path.dirname(job_dir)}/mlflow.db")}
    # generator reports (idle fraction, the sampled reward) reach the learner's rows every second, unless overridden;
    # no evaluation rounds (TRL's runs evaluate nothing either; the judge evaluates both), unless overridden; one
    # checkpoint, after the last step, in this run's own directory (never resumed from another run's); a free port,
    # unless overridden (the default one, 47500, is any other job's too: a run here found it taken and failed)
    from asyncrl.bench.buffer import free_port

    command = [sys.executable, "-m", "asyncrl.launch.cli", "run", "--config", recipe, "generator.log_every_s=1",
               "eval.every_steps=0", "eval.before_train=false", f"buffer.port={free_port()}", *overrides,
               f"learner.total_steps={steps}", f"learner.seed={seed}", f"generator.seed={seed}",
               f"learner.checkpoint_every={steps}", f"learner.checkpoint_dir={final_checkpoints(job_dir)}",
               "telemetry.progress=false"]
    check(subprocess.run(command, env=env, capture_output=True, text=True), job_dir)


def final_checkpoints(job_dir: str) -> str:
    """Where an asyncrl run of this bench checkpoints (the root: `asyncrl eval` takes its newest)."""
    return os.path.join(job_dir, "checkpoints")


def run_trl(job_dir: str, recipe: str, seed: int, steps: int, threads: int, overrides: list) -> None:
    command = [sys.executable, "-m", "asyncrl.bench.trl_grpo", "--job-dir", job_dir, "--config", recipe, "--seed",
               str(seed), "--steps", str(steps), "--threads", str(threads), *overrides]
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


COLUMNS = (("time_to_target_s", "time to target s"), ("steps_to_target", "steps to target"),
           ("step_wall_s", "s per step"), ("reward_at_budget", "reward at budget"),
           ("reward_final", "final reward"), ("heldout_greedy_reward", "held-out greedy"),
           ("heldout_greedy_pass", "held-out greedy exact"), ("heldout_t1_reward", "T=1 reward"),
           ("heldout_pass_at_1", "pass@1"), ("heldout_pass_at_k", "pass@k"), ("heldout_t1_tool_use", "T=1 tool use"),
           ("samples_per_s", "samples/s"),
           ("learner_idle_frac", "learner idle"), ("generator_idle_frac", "gen idle"),
           ("staleness_mean", "staleness"), ("is_weight_mean", "IS mean"), ("is_weight_max", "IS max"))
"""Every run's numbers (the JSON line has them all); a task's table shows those some run of it has."""
TRL = "TRL GRPOTrainer"
DEFAULT = "asyncrl default"
ETA0 = "asyncrl eta=0"


def print_table(configs: dict, skipped: dict) -> None:
    """One row per configuration (median [min, max] over seeds), one column per number some run has."""
    shown = [(key, label) for key, label in COLUMNS
             if any(run.get(key) is not None for runs in configs.values() for run in runs)]
    print("| run | " + " | ".join(label for _, label in shown) + " |")
    print("|---|" + "---|" * len(shown))
    for name, runs in configs.items():
        if name in skipped:
            print(f"| {name} | n/a: {skipped[name]} |" + " |" * (len(shown) - 1))
            continue
        cells = [spread([run.get(key) for run in runs]) for key, _ in shown]
        print(f"| {name} | " + " | ".join(cells) + " |")


def ratio(numerator, denominator) -> float | None:
    """numerator / denominator, None where either is missing (a target not reached) or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


SUMMARY_LABELS = {"task": "task", "ttt_default_over_trl": "time to target, default / TRL",
                  "ttt_default_over_eta0": "time to target, default / η = 0",
                  "wall_default_over_eta0": "s per step, default / η = 0",
                  "steps_default_over_eta0": "steps to target, default / η = 0",
                  "heldout_default": "held-out greedy, default", "heldout_trl": "held-out greedy, TRL",
                  "heldout_eta0": "held-out greedy, η = 0"}


def summary_rows(medians: dict) -> list:
    """Per task (`medians`: task -> configuration -> key -> median over seeds): time to target of the default over
    TRL's and over η = 0's, and the held-out greedy reward of each; then the median of each over the tasks that
    have it (a task where one side never reached its target has no ratio: its table says which)."""
    rows = []
    for task, configs in medians.items():
        default, trl, eta0 = (configs.get(name, {}) for name in (DEFAULT, TRL, ETA0))
        rows.append({"task": task,
                     "ttt_default_over_trl": ratio(default.get("time_to_target_s"), trl.get("time_to_target_s")),
                     "ttt_default_over_eta0": ratio(default.get("time_to_target_s"), eta0.get("time_to_target_s")),
                     "wall_default_over_eta0": ratio(default.get("step_wall_s"), eta0.get("step_wall_s")),
                     "steps_default_over_eta0": ratio(default.get("steps_to_target"), eta0.get("steps_to_target")),
                     "heldout_default": default.get("heldout_greedy_reward"),
                     "heldout_trl": trl.get("heldout_greedy_reward"),
                     "heldout_eta0": eta0.get("heldout_greedy_reward")})
    keys = [key for key in SUMMARY_LABELS if key != "task"]
    overall = {key: median_or_none([row[key] for row in rows if row[key] is not None]) for key in keys}
    return rows + [{"task": f"median over {len(rows)} tasks", **overall}]


def print_summary(rows: list) -> None:
    print("| " + " | ".join(SUMMARY_LABELS.values()) + " |")
    print("|---|" + "---|" * (len(SUMMARY_LABELS) - 1))
    for row in rows:
        cells = [row["task"], *("-" if row[key] is None else f"{row[key]:.3g}" for key in list(SUMMARY_LABELS)[1:])]
        print("| " + " | ".join(cells) + " |")


def sync_threads(learner_threads: int, generator_threads: int) -> list:
    """η = 0's thread overrides: each phase gets the threads both get in the asynchronous recipe (their phases
    never overlap); none where a side already takes every core (0)."""
    if not learner_threads or not generator_threads:
        return []
    total = learner_threads + generator_threads
    return [f"learner.torch_threads={total}", f"generator.torch_threads={total}"]


def heldout_columns(scores: dict, ks: tuple) -> dict:
    """The judge's scores under the run's keys (pass@k: the largest k judged; tool use where the task's samples are
    episodes)."""
    top = max(ks)
    return {"heldout_greedy_reward": scores["greedy_reward"], "heldout_greedy_pass": scores["greedy_pass"],
            "heldout_t1_reward": scores["t1_reward"], "heldout_pass_at_1": scores.get("pass_at_1"),
            "heldout_pass_at_k": scores.get(f"pass_at_{top}"), "heldout_k": top,
            **{f"heldout_pass_at_{k}": scores[f"pass_at_{k}"] for k in ks},
            **({"heldout_t1_tool_use": scores["t1_tool_use"]} if "t1_tool_use" in scores else {})}


def plan_runs(cfg, configs: list, etas: list, variants: list) -> list:
    """(label, overrides; None for TRL) of each run of a task, in the order they run."""
    plan = []
    if "default" in configs:
        plan.append((DEFAULT, []))
    if "eta0" in configs:
        plan.append((ETA0, ["buffer.max_staleness=0",
                            *sync_threads(cfg.learner.torch_threads, cfg.generator.torch_threads)]))
    plan += [(f"asyncrl eta={eta}", [f"buffer.max_staleness={eta}"]) for eta in etas]
    plan += [(f"asyncrl {name}", overrides) for name, overrides in variants]
    if "trl" in configs:
        plan.append((TRL, None))
    return plan


def set_up_task(task, args) -> dict:
    """A task's runs and their settings: its config (recipe, task overrides, the command line's), the plan, steps,
    target, samples per step, threads for TRL, and the configurations it cannot run (label -> why)."""
    from asyncrl.bench.trl_grpo import unsupported_reason
    from asyncrl.configs import load_config

    overrides = [*task.overrides, *args.overrides]
    cfg = load_config(task.recipe, overrides)
    plan = plan_runs(cfg, args.configs, args.etas, args.variant)
    reason = unsupported_reason(cfg)
    return {"task": task, "overrides": overrides, "plan": plan, "skipped": {TRL: reason} if reason else {},
            "steps": args.steps or task.steps, "target": task.target if args.target is None else args.target,
            "samples_per_step": cfg.buffer.groups_per_step * cfg.rollout.n,
            "threads": (cfg.learner.torch_threads + cfg.generator.torch_threads) if cfg.learner.torch_threads and
            cfg.generator.torch_threads else 0}


def one_run(setup: dict, label: str, extra, seed: int, job_dir: str, args) -> tuple[dict, tuple]:
    """Train one configuration, read its progress, judge its final model: (its numbers, (elapsed, rewards)).

    With --keep, what a run finished is kept in its job directory, so a suite cut short (hours on 2 cores) goes on
    where it stopped when the same command is run again: TRAINED (the run's numbers and curve, written once its
    training ended) and JUDGED (the judge's scores). A job directory without TRAINED is a run cut short: it is
    emptied and run again."""
    from asyncrl.bench.judge import judge

    task, steps = setup["task"], setup["steps"]
    settings = {"recipe": task.recipe, "steps": steps, "seed": seed, "target": setup["target"],
                "window": args.window, "final_steps": args.final_steps,
                "overrides": list(args.overrides) if extra is None else [*setup["overrides"], *extra]}
    trained = read_json(os.path.join(job_dir, TRAINED))
    if trained is not None and trained["settings"] != settings:
        raise SystemExit(f"{job_dir} holds a run with other settings ({trained['settings']}, not {settings}): "
                         f"give another --keep, or remove that directory")
    if trained is None:
        shutil.rmtree(job_dir, ignore_errors=True)
        if extra is None:
            run_trl(job_dir, task.recipe, seed, steps, setup["threads"], args.overrides)
        else:
            run_asyncrl(job_dir, task.recipe, seed, steps, [*setup["overrides"], *extra])
        progress = read_progress(job_dir)
        run = summarize(progress, setup["samples_per_step"], setup["target"], args.window, float("inf"),
                        args.final_steps)
        trained = {"settings": settings, "run": run, "curve": [[row["elapsed_s"] for row in progress], [row_reward(row) for row in progress]]}
        write_json(os.path.join(job_dir, TRAINED), trained)
    judge_settings = {"n": args.judge_n, "ks": list(args.judge_ks), "prompts": args.judge_prompts,
                      "overrides": list(args.overrides)}
    judged = read_json(os.path.join(job_dir, JUDGED)) or {}
    scores = judged.get("scores") if judged.get("settings") == judge_settings else None
    if scores is None:
        final = os.path.join(job_dir, "final") if extra is None else final_checkpoints(job_dir)
        # the judge reads the task's overrides and the command line's, never a configuration's (η, threads, variant
        # settings): every model of the task is scored alike
        scores = judge(final, task, args.judge_n, tuple(args.judge_ks), tuple(args.overrides), args.judge_prompts)
        write_json(os.path.join(job_dir, JUDGED), {"settings": judge_settings, "scores": scores})
    ks = tuple(k for k in args.judge_ks if k <= args.judge_n)
    # derived from the kept curve, so runs kept before this column existed have it too
    reached = steps_to_target(trained["curve"][1], setup["target"], args.window)
    return ({"seed": seed, **trained["run"], "steps_to_target": reached, **heldout_columns(scores, ks)},
            tuple(trained["curve"]))


def slug(label: str) -> str:
    """A configuration's label as a folder name ("asyncrl eta=0" -> "asyncrl-eta-0"): a run's directory is named by
    what it runs, not by its place in the plan, so a resumed suite with other --configs finds each run's own."""
    return "-".join("".join(c if c.isascii() and c.isalnum() else " " for c in label).split()) or "run"


TRAINED, JUDGED = "trained.json", "judged.json"
"""What a finished run leaves in its job directory (one_run): its numbers and curve, then the judge's scores."""


def read_json(path: str):
    """The JSON in `path`, or None where there is none (a run not yet finished)."""
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def write_json(path: str, value) -> None:
    """Written whole or not at all (a rename), so a run killed while writing leaves no half file to resume from."""
    with open(path + ".tmp", "w") as handle:
        json.dump(value, handle)
    os.replace(path + ".tmp", path)


def fill_budget(runs: list, curves: list, budget_s: float | None, window: int) -> float:
    """Each run's reward at the budget: `budget_s`, else the shortest span of these runs (a time all reached)."""
    budget = budget_s or min(elapsed[-1] - elapsed[0] for elapsed, _ in curves)
    for run, (elapsed, rewards) in zip(runs, curves):
        run["reward_at_budget"] = reward_at_budget(elapsed, rewards, budget, window)
    return budget


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=None, help="tasks of bench/suite/tasks.py::SUITE (all)")
    parser.add_argument("--root", default=os.path.expanduser("~/.cache/asyncrl/suite"),
                        help="where the suite's tasks are built and cached")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="*", default=["default", "eta0", "trl"],
                        choices=["default", "eta0", "trl"])
    parser.add_argument("--no-trl", action="store_true", help="leave TRL out (it is the `bench` extra)")
    parser.add_argument("--etas", type=int, nargs="*", default=[], help="one more asyncrl run per η")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        help="NAME=key=value,... : one more asyncrl run per seed with these overrides")
    parser.add_argument("--steps", type=int, default=0, help="RL steps of every run (0: each task's own)")
    parser.add_argument("--target", type=float, default=None, help="the target reward (default: each task's)")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="reward at this many seconds (default: each task's shortest run)")
    parser.add_argument("--final-steps", type=int, default=50)
    parser.add_argument("--judge-n", type=int, default=8, help="the judge's samples per prompt at T = 1")
    parser.add_argument("--judge-ks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--judge-prompts", type=int, default=0, help="judge the first N held-out prompts (0: all)")
    parser.add_argument("--keep", help="keep every run's job directory under this path; run again with the same "
                                       "--keep, the suite goes on where it stopped (finished runs are read back)")
    parser.add_argument("overrides", nargs="*", help="overrides for every run, asyncrl and TRL alike, after the "
                                                     "task's")
    args = parser.parse_args(argv)
    if args.no_trl:
        args.configs = [name for name in args.configs if name != "trl"]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from asyncrl.bench.suite.tasks import SUITE, build_task

    setups = {name: set_up_task(build_task(name, args.root), args) for name in args.tasks or list(SUITE)}
    workdir = args.keep or tempfile.mkdtemp(prefix="asyncrl-ttr-")
    results = {name: {label: [] for label, _ in setup["plan"]} for name, setup in setups.items()}
    curves = {name: {label: [] for label, _ in setup["plan"]} for name, setup in setups.items()}
    for seed in args.seeds:  # seeds outermost: a drift in the machine's speed hits every task and config alike
        for name, setup in setups.items():
            for label, extra in setup["plan"]:
                if label in setup["skipped"]:
                    continue
                job_dir = os.path.join(workdir, name, f"seed{seed}-{slug(label)}")
                run, curve = one_run(setup, label, extra, seed, job_dir, args)
                results[name][label].append(run)
                curves[name][label].append(curve)
                print(f"{name} {label} seed {seed}: {json.dumps(run)}", file=sys.stderr, flush=True)
    medians, budgets = {}, {}
    for name, setup in setups.items():
        ran = [label for label, runs in results[name].items() if runs]
        budgets[name] = fill_budget([run for label in ran for run in results[name][label]],
                                    [curve for label in ran for curve in curves[name][label]], args.budget_s,
                                    args.window) if ran else None
        medians[name] = {label: {key: median_or_none([run.get(key) for run in runs]) for key, _ in COLUMNS}
                         for label, runs in results[name].items() if runs}
        print(f"\n{name}: target {setup['target']} (mean of {args.window} steps), budget {budgets[name] or 0:.0f} s, "
              f"final = last {args.final_steps} of {setup['steps']} steps; median [min, max] over seeds {args.seeds}")
        print_table(results[name], setup["skipped"])
    summary = summary_rows(medians)
    print("\nsummary (ratios of the medians over seeds; < 1: the default is faster)")
    print_summary(summary)
    result = {"bench": "time_to_reward", "tasks": list(setups), "seeds": args.seeds,
              "steps": {name: setup["steps"] for name, setup in setups.items()},
              "targets": {name: setup["target"] for name, setup in setups.items()}, "budgets_s": budgets,
              "skipped": {name: setup["skipped"] for name, setup in setups.items()}, "summary": summary,
              "medians": medians, "runs": results}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
