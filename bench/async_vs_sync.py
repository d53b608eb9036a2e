"""Async vs sync on the demo workload: trained samples per second at η = 0 (synchronous) and at the demo's η.

Both runs are full `asyncrl run` jobs in this process's job, one after the other, with the same recipe and
overrides. Throughput is measured between the first and the last optimizer step, so engine start-up and the demo
build are excluded. It reports; it does not assert. Usage:
    python -m asyncrl.bench.async_vs_sync [--steps N] [--eta K] [overrides...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run_once(eta: int, steps: int, overrides: list, workdir: str) -> dict:
    job_dir = os.path.join(workdir, f"eta{eta}")
    env = {**os.environ, "ASYNCRL_JOB_DIR": job_dir, "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/mlflow.db")}
    command = [sys.executable, "-m", "asyncrl.launch.cli", "run", *overrides, f"buffer.max_staleness={eta}",
               f"learner.total_steps={steps}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"run with eta={eta} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    with open(os.path.join(job_dir, "progress.jsonl")) as handle:
        progress = [json.loads(line) for line in handle]
    from asyncrl.configs import load_config

    cfg = load_config(None, overrides)
    samples_per_step = cfg.buffer.groups_per_step * cfg.rollout.n
    span = progress[-1]["elapsed_s"] - progress[0]["elapsed_s"]
    window = max(1, len(progress) // 10)
    return {
        "eta": eta,
        "steps": len(progress),
        "samples_per_s": samples_per_step * (len(progress) - 1) / max(span, 1e-9),
        "reward_first": sum(p["reward/mean"] for p in progress[:window]) / window,
        "reward_last": sum(p["reward/mean"] for p in progress[-window:]) / window,
        "staleness_mean": sum(p["buffer/staleness/mean"] for p in progress) / len(progress),
        "step_s": sum(p["timing/learner/step_s"] for p in progress) / len(progress),
        "wait_for_batch_s": sum(p["timing/learner/wait_for_batch_s"] for p in progress) / len(progress),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eta", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as workdir:
        sync = run_once(0, args.steps, args.overrides, workdir)
        async_ = run_once(args.eta, args.steps, args.overrides, workdir)
    print(f"{'mode':<12}{'eta':>4}{'samples/s':>12}{'step_s':>9}{'wait_s':>9}{'staleness':>11}{'reward first->last':>22}")
    for name, row in (("sync", sync), ("async", async_)):
        print(f"{name:<12}{row['eta']:>4}{row['samples_per_s']:>12.1f}{row['step_s']:>9.3f}{row['wait_for_batch_s']:>9.3f}"
              f"{row['staleness_mean']:>11.2f}{row['reward_first']:>11.3f} -> {row['reward_last']:.3f}")
    result = {"bench": "async_vs_sync", "speedup": async_["samples_per_s"] / sync["samples_per_s"],
              "sync": sync, "async": async_}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
