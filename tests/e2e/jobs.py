"""Helpers shared by the end-to-end tests: a job's environment, overrides and progress log, and a learner
process driven by a scripted generator (its groups, starting it, and waiting for it and its ranks to end)."""
import json
import os
import subprocess
import sys
import time

import numpy as np

from asyncrl.buffer.group import Group, Sample, Sampling
from tests.conftest import DEMO


def common_overrides(demo_cache, port, steps, eta=1):
    return [f"demo.cache_dir={demo_cache}", *DEMO, f"buffer.port={port}",
            f"learner.total_steps={steps}", f"buffer.max_staleness={eta}", "buffer.groups_per_step=4",
            "rollout.n=4", "generator.max_inflight_groups=4", "generator.log_every_s=1", "generator.kv_cache_gib=0.25",
            "eval.every_steps=0", "eval.before_train=false",  # the recipe's held-out evaluation: one test asks for it
            *QUIET_TELEMETRY]


QUIET_TELEMETRY = ["telemetry.plots=false", "telemetry.system_metrics_every_s=0"]
"""Drawing the plots costs seconds per job, on CI's two cores; one test (test_asyncrl_run_trains_logs_to_mlflow...)
turns both back on and checks them."""


def supervised_overrides(demo_cache, port):
    """A small `asyncrl run` job on the hf engine, without evaluation: what the supervisor's tests start."""
    return [f"demo.cache_dir={demo_cache}", *DEMO, f"buffer.port={port}",
            "generator.engine=hf", "buffer.groups_per_step=2", "rollout.n=2", "generator.max_inflight_groups=2",
            "eval.every_steps=0", "eval.before_train=false",  # the recipe's held-out evaluation is not tested here
            *QUIET_TELEMETRY]


def children_of(job_dir):
    """PIDs the supervisor started, read from /proc by their job directory in the environment."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if f"ASYNCRL_JOB_DIR={job_dir}".encode() in handle.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def job_env(tmp_path):
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "HF_HUB_OFFLINE": "1"}


def mlflow_metric_keys(tmp_path, run_id):
    from mlflow.tracking import MlflowClient

    return set(MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id).data.metrics)


def read_progress(job_dir):
    with open(os.path.join(job_dir, "progress.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def subset_parquet(source: str, path: str, rows: int) -> list:
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(source).slice(0, rows), path)
    return [f"{os.path.basename(path)}:{index}" for index in range(rows)]


VOCAB = 64


GROUPS_PER_STEP = 2


N = 4


SAMPLING = Sampling(temperature=1.0, max_tokens=16)
"""The recipe's sampling (the resume tests set rollout.max_tokens to match): the learner rejects any other."""


def scripted_group(version: int, index: int, incarnation: int) -> Group:
    rng = np.random.default_rng(version * 1000 + index)
    samples = []
    for _ in range(N):
        length = int(rng.integers(2, 10))
        samples.append(Sample(completion_ids=rng.integers(2, VOCAB, length).astype(np.int32),
                              logprobs=-rng.random(length).astype(np.float32) * 3,
                              versions=np.full(length, version, np.int32), reward=float(rng.integers(0, 2)),
                              finish_reason="stop"))
    return Group(group_id=f"i{incarnation}-v{version}-{index}", prompt_id=str(index), generator_id="scripted",
                 prompt_ids=rng.integers(2, VOCAB, 5).astype(np.int32), samples=samples,
                 sampling=SAMPLING, created_at=time.time())


def start_learner(overrides, job_dir, tmp_path, nproc: int, extra=()):
    env = {**os.environ, "ASYNCRL_JOB_DIR": str(job_dir), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    log = open(os.path.join(job_dir, f"learner-{time.monotonic_ns()}.log"), "wb")
    command = [sys.executable, "-m", "asyncrl.launch.cli", "learner", *(["--nproc", str(nproc)] if nproc > 1 else []),
               *extra, *overrides]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            cwd=tmp_path), log  # MLflow writes run artifacts under the working directory


def run_to_end(proc, log, timeout_s=300):
    try:
        code = proc.wait(timeout=timeout_s)
    finally:
        log.close()
    assert code == 0, open(log.name).read()[-3000:]


def child_pids(pid: int) -> list:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(child) for child in handle.read().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def wait_until_gone(pids, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while alive(pid):
            assert time.monotonic() < deadline, f"rank {pid} outlived its killed launcher"
            time.sleep(0.05)


def effective_prompts(path) -> dict:
    """step -> prompts, as the final model saw them (bench/soak/history.py::effective_timeline: a resumed life
    replaces what the previous life recorded from its first step on)."""
    from asyncrl.bench.soak.history import effective_timeline, read_jsonl

    return {step: row["prompts"] for step, row in effective_timeline(read_jsonl(str(path))).items()}
