"""Where each suite task's RL starts: the held-out reward of its `asyncrl sft` warm start, sampled at T = 1 (4
samples a prompt) and greedy, scored by `asyncrl eval` with the task's recipe and reward (the same judge as a
finished run's). The suite asks for a T = 1 reward between 0.2 and 0.4: room to learn, but not from nothing.
It reports; it does not assert. Usage:

    python -m asyncrl.bench.suite.warm_start [--tasks digit_words sort_letters spell_backward] [--root DIR] [--seed S]

Builds what is missing (through the public path, bench/suite/assets.py), then prints one row per task and one final
JSON line.
"""
import argparse
import json
import os
import subprocess
import sys
import time

from asyncrl.bench.suite.tasks import SUITE, build_task

BUILT_TASKS = ("digit_words", "sort_letters", "spell_backward")
"""The tasks this benchmark builds by default: the suite's own (the demos' warm starts are measured with them)."""


def eval_reward(task, model: str, temperature: float, n: int) -> float:
    """`asyncrl eval` of `model` on the task's held-out files: the mean reward over every data source's samples."""
    recipe = ["--config", task.recipe] if task.recipe else []
    argv = [sys.executable, "-m", "asyncrl.launch.cli", "eval", *recipe, "--checkpoint", model, "--files",
            *task.test_files, *task.overrides, f"eval.temperature={temperature}", f"eval.n={n}",
            "telemetry.plots=false"]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "ASYNCRL_"))}
    env = {"OMP_NUM_THREADS": "1", **env, "HF_HUB_OFFLINE": "1"}  # one thread, as the warm start was built
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    return metrics["eval/all/mean_reward"] if "eval/all/mean_reward" in metrics else \
        [value for key, value in metrics.items() if key.endswith("/mean_reward")][0]


def measure(name: str, root: str, seed: int) -> dict:
    started = time.monotonic()
    task = build_task(name, root, seed)
    built_s = time.monotonic() - started
    if not task.warm_start:
        raise ValueError(f"suite task {name} has no warm_start model of its own (a demo builds it in its run)")
    return {"task": name, "seed": seed, "build_s": round(built_s, 1),
            "t1_reward": eval_reward(task, task.warm_start, 1.0, 4),
            "greedy_reward": eval_reward(task, task.warm_start, 0.0, 1), "model": task.warm_start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(BUILT_TASKS), choices=list(SUITE))
    parser.add_argument("--root", default=os.path.expanduser("~/.cache/asyncrl/suite"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [measure(name, args.root, args.seed) for name in args.tasks]
    print(f"{'task':<16} {'seed':>4} {'T=1 reward':>10} {'greedy':>8} {'build s':>8}")
    for row in rows:
        print(f"{row['task']:<16} {row['seed']:>4} {row['t1_reward']:>10.3f} {row['greedy_reward']:>8.3f} "
              f"{row['build_s']:>8.1f}")
    print(json.dumps({"bench": "suite_warm_start", "runs": rows}))


if __name__ == "__main__":
    main()
