"""The same small job under `asyncrl run`, `asyncrl ray` on an existing Ray cluster and, with `--slurm-redis-url`,
`asyncrl slurm`'s scripts on an existing SLURM cluster: the wall time from the command to the first trained step and
to the job's end, alternating launchers so that all see the same machine.

The job is the SLURM test's (tests/integration/test_slurm_real.py): the demo recipe, 12 steps, η = 0, one group in
flight per generator, two generators on the hf engine, so a step waits for a weight sync and the times are mostly
processes, imports and engines starting: what a launcher adds. Start a cluster first (`ray start --head`, and
`ray start --address` for a second node; docs/multinode.md), then:

    python -m asyncrl.bench.launchers --ray-address 127.0.0.1:6379 --repeats 2

With `--slurm-redis-url redis://host:6379/0` (SLURM's jobs meet in Redis; sbatch and squeue on PATH, SLURM_CONF set
as for any SLURM command) the job also runs as `asyncrl slurm --gpus-per-node 0 --gpus-per-generator 0
--no-exclusive` writes it, `submit.sh` timed until the learner job leaves the queue.

The last line is JSON: the medians per launcher and each one's over run's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

POLL_S = 0.2
TIMEOUT_S = 600


def job_overrides(demo_cache: str, steps: int, port: int) -> list:
    return [f"demo.cache_dir={demo_cache}", "demo.sft_steps=20", "demo.num_prompts=256", f"buffer.port={port}",
            f"learner.total_steps={steps}", "buffer.max_staleness=0", "buffer.groups_per_step=4", "rollout.n=4",
            "generator.max_inflight_groups=1", "generator.engine=hf", "generator.log_every_s=1",
            "learner.torch_threads=1", "algo.dynamic_sampling=false", "eval.every_steps=0", "eval.before_train=false",
            "telemetry.plots=false", "telemetry.system_metrics_every_s=0"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_job(command: list, job_dir: str, env: dict) -> dict:
    """Seconds from starting `command` to the job's first progress record and to the command's exit."""
    progress = os.path.join(job_dir, "progress.jsonl")
    began = time.monotonic()
    with open(os.path.join(os.path.dirname(job_dir), "command.log"), "ab") as log:
        proc = subprocess.Popen(command, env={**env, "ASYNCRL_JOB_DIR": job_dir}, stdout=log,
                                stderr=subprocess.STDOUT, cwd=os.path.dirname(job_dir))
    first = None
    while proc.poll() is None:
        if first is None and os.path.exists(progress) and os.path.getsize(progress) > 0:
            first = time.monotonic() - began
        if time.monotonic() - began > TIMEOUT_S:
            proc.kill()
            raise RuntimeError(f"{command[3]} did not finish within {TIMEOUT_S} s; see {job_dir}/../command.log")
        time.sleep(POLL_S)
    end = time.monotonic() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{command[3]} exited {proc.returncode}; see {os.path.dirname(job_dir)}/command.log")
    return {"first_step_s": first if first is not None else end, "end_s": end}


def commands(args, overrides: list) -> dict:
    cli = [sys.executable, "-m", "asyncrl.launch.cli"]
    ray = [*cli, "ray", "--generators", str(args.generators), "--address", args.ray_address]
    if args.learner_resources:
        ray += ["--learner-resources", args.learner_resources]
    if args.generator_resources:
        ray += ["--generator-resources", args.generator_resources]
    return {"run": [*cli, "run", "--generators", str(args.generators), *overrides],
            "ray": [*ray, *overrides]}


def time_slurm(args, overrides: list, job_dir: str, env: dict) -> dict:
    """`asyncrl slurm`'s scripts for the job, `submit.sh` timed until the learner job has left the queue."""
    import re
    import uuid

    scripts = os.path.join(os.path.dirname(job_dir), "scripts")
    bin_dir = os.path.dirname(sys.executable)  # the scripts run `asyncrl`: this environment's
    env = {**env, "PATH": f"{bin_dir}:{env.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "asyncrl.launch.cli"]
    overrides = [*overrides, f"buffer.redis.namespace=bench{uuid.uuid4().hex[:8]}",
                 f"job.out_dir={os.path.dirname(job_dir)}", "job.name=job"]
    subprocess.run([*cli, "slurm", "--out", scripts, "--redis-url", args.slurm_redis_url, "--gpus-per-node", "0",
                    "--gpus-per-generator", "0", "--generators", str(args.generators), "--no-exclusive",
                    "--master-port", str(free_port()), *overrides], env=env, check=True, capture_output=True)
    progress = os.path.join(job_dir, "progress.jsonl")
    began = time.monotonic()
    submitted = subprocess.run(["bash", os.path.join(scripts, "submit.sh")], env=env, check=True,
                               capture_output=True, text=True).stdout
    learner = re.search(r"learner job (\d+) submitted", submitted).group(1)
    first = None
    while subprocess.run(["squeue", "-h", "-j", learner], env=env, capture_output=True, text=True).stdout.strip():
        if first is None and os.path.exists(progress) and os.path.getsize(progress) > 0:
            first = time.monotonic() - began
        if time.monotonic() - began > TIMEOUT_S:
            subprocess.run(["scancel", learner], env=env)
            raise RuntimeError(f"the SLURM job {learner} did not finish within {TIMEOUT_S} s; see {job_dir}")
        time.sleep(POLL_S)
    end = time.monotonic() - began
    return {"first_step_s": first if first is not None else end, "end_s": end}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ray-address", default="", help="the running Ray cluster (ray start's address)")
    parser.add_argument("--learner-resources", default="", help="passed to asyncrl ray, e.g. '{\"learner\": 1}'")
    parser.add_argument("--generator-resources", default="", help="passed to asyncrl ray")
    parser.add_argument("--slurm-redis-url", default="", help="also time asyncrl slurm's scripts (their Redis)")
    parser.add_argument("--launchers", default="run,ray", help="which to time, of run, ray and slurm (the "
                        "ratios need run; --slurm-redis-url adds slurm)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--demo-cache", default=os.path.expanduser("~/.cache/asyncrl/demo"))
    parser.add_argument("--out", default="", help="where the job directories go (default: a temp dir)")
    args = parser.parse_args(argv)
    launchers = [name for name in ("run", "ray", "slurm") if name in args.launchers.split(",")]
    if args.slurm_redis_url and "slurm" not in launchers:
        launchers.append("slurm")
    if not launchers or ("slurm" in launchers and not args.slurm_redis_url) or (
            "ray" in launchers and not args.ray_address):
        parser.error(f"--launchers {args.launchers!r}: name some of run, ray, slurm; ray needs --ray-address and "
                     f"slurm --slurm-redis-url")
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import prepare_demo

    cfg = load_config(None, job_overrides(args.demo_cache, args.steps, 0)[:3])
    prepare_demo(cfg.demo, cfg.job.seed, say=lambda message: None)  # built once, outside the timings
    out = args.out or tempfile.mkdtemp(prefix="asyncrl-launchers-")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "MLFLOW_TRACKING_URI": f"sqlite:///{out}/mlflow.db"}
    rows = []
    for repeat in range(args.repeats):
        overrides = job_overrides(args.demo_cache, args.steps, free_port())
        for name in launchers:
            job_dir = os.path.join(out, f"{name}-{repeat}", "job")
            os.makedirs(job_dir)
            timed = (time_slurm(args, overrides, job_dir, env) if name == "slurm"
                     else time_job(commands(args, overrides)[name], job_dir, env))
            rows.append({"launcher": name, "repeat": repeat, **timed})
            print(f"{name:>5} #{repeat}: first step {timed['first_step_s']:6.1f} s, end {timed['end_s']:6.1f} s",
                  flush=True)
    medians = {name: {key: statistics.median(row[key] for row in rows if row["launcher"] == name)
                      for key in ("first_step_s", "end_s")} for name in launchers}
    print("\n| launcher | first trained step (median s) | job end (median s) |\n|---|---|---|")
    for name, median in medians.items():
        print(f"| asyncrl {name} | {median['first_step_s']:.1f} | {median['end_s']:.1f} |")
    print(json.dumps({"steps": args.steps, "repeats": args.repeats, "medians": medians,
                      "over_run": {name: {key: medians[name][key] / medians["run"][key]
                                          for key in ("first_step_s", "end_s")} for name in launchers}
                      if "run" in medians else {}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
