"""`asyncrl slurm`'s scripts under a real SLURM: a one-node cluster of our own (scripts/ensure_slurm: Debian's
slurmctld, slurmd and munged on 127.0.0.1 in a temp dir, stopped by PID), the scripts submitted exactly as
written (submit.sh, the learner job and the generator array), on CPUs with the demo recipe and a few steps.

The job runs through what a cluster does to it: a generator task cancelled with scancel (the job trains on), the
last generator cancelled too (it must be gone within 20 s, not at SIGKILL after KillWait's 30 s: a generator that
swallowed scancel's SIGTERM trained on, generator/event_loop.py; the learner waits), and a generator array
submitted later, which must join and train the job to its last step: by then it is the only generator, so the job
can only end through it. `sacct` reads the job completion log (jobcomp/filetxt: there is no slurmdbd here, and
sacct without one says "accounting storage is disabled"), so it is `sacct --completion`."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import alive, common_overrides, job_env, read_progress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAEMONS = ("slurmd", "slurmctld", "munged")
"""Stopped in this order: slurmd before the controller it reports to, munge (their authentication) last."""


class SlurmCluster:
    def __init__(self, directory: str):
        self.directory = directory
        self.env = {**os.environ, "SLURM_CONF": os.path.join(directory, "slurm.conf")}

    def run(self, *command: str, env=None, cwd=None) -> str:
        out = subprocess.run(command, env=env or self.env, cwd=cwd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{command} exited {out.returncode}: {out.stdout}{out.stderr}"
        return out.stdout

    def state(self, job_id: str) -> str:
        """The job's (or array task's) state as the controller knows it: PENDING, RUNNING, COMPLETED, ..."""
        text = self.run("scontrol", "show", "job", "-o", job_id)
        return re.search(r"JobState=(\S+)", text).group(1)

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = os.path.join(self.directory, name)
            if os.path.exists(path):
                parts.append(f"--- {name}\n" + open(path).read()[-3000:])
        return "\n".join(parts)


def stop_by_pid(pid_file: str, timeout_s: float = 20) -> None:
    if not os.path.exists(pid_file):
        return
    pid = int(open(pid_file).read().split()[0])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:  # a daemon: its parent is init, which may never reap it
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = [name for name in ("munged", "slurmctld", "slurmd", "sbatch", "sacct") if shutil.which(name) is None]
    if missing:
        pytest.skip(f"SLURM is not installed here ({', '.join(missing)} missing): scripts/ensure_slurm installs "
                    "Debian's slurmctld, slurmd, slurm-client and munge (scripts/test runs it)")
    directory = str(tmp_path_factory.mktemp("slurm"))
    cluster = SlurmCluster(directory)
    try:
        out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ensure_slurm"), "start", directory,
                              str(free_port()), str(free_port())], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"ensure_slurm start failed: {out.stderr}\n{cluster.logs()}"
        yield cluster
    finally:
        jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env=cluster.env, capture_output=True, text=True,
                              timeout=60).stdout.split()
        if jobs:  # a failed test's jobs: their processes belong to slurmstepd, which outlives slurmd
            subprocess.run(["scancel", *sorted(set(jobs))], env=cluster.env, timeout=60)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h"], env=cluster.env, capture_output=True, text=True, timeout=60).stdout.strip():
                time.sleep(0.5)
        for name in DAEMONS:
            stop_by_pid(os.path.join(directory, f"{name}.pid"))


def wait_for(what: str, check, timeout_s: float, cluster: SlurmCluster, job_dir: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            names = sorted(os.listdir(job_dir)) if os.path.isdir(job_dir) else []
            logs = "\n".join(f"--- {name}\n{open(os.path.join(job_dir, name)).read()[-3000:]}"
                             for name in names if name.endswith(".log"))
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{logs}\n{cluster.logs()}")
        time.sleep(0.5)


def steps_done(job_dir: str) -> int:
    try:
        return len(read_progress(job_dir))
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line being written
        return 0


STEPS = 12


@pytest.mark.slow
@pytest.mark.redis
def test_the_sbatch_scripts_train_a_job_under_real_slurm(slurm_cluster, redis_server, tmp_path, demo_assets,
                                                         demo_cache):
    # eta=0 and one group in flight: a generator waits for each version, so a step takes a weight sync (the
    # demo model trains a step in a fraction of a second: gen-0 would otherwise train the whole job before the
    # test could cancel it)
    overrides = common_overrides(demo_cache, free_port(), steps=STEPS, eta=0) + [
        "generator.max_inflight_groups=1", "generator.engine=hf", f"buffer.redis.namespace=slurm{uuid.uuid4().hex[:8]}",
        "learner.torch_threads=1", "algo.dynamic_sampling=false", f"job.out_dir={tmp_path}", "job.name=slurmjob"]
    scripts = tmp_path / "scripts"
    bin_dir = os.path.dirname(sys.executable)  # the installed `asyncrl`, as on a cluster's nodes
    env = {**job_env(tmp_path), **slurm_cluster.env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # sbatch exports the submitter's environment
    slurm_cluster.run(os.path.join(bin_dir, "asyncrl"), "slurm", "--out", str(scripts), "--redis-url",
                      redis_server.url, "--gpus-per-node", "0", "--gpus-per-generator", "0", "--generators", "2",
                      "--cpus-per-generator", "2", "--no-exclusive", "--master-port", str(free_port()), "--time",
                      "00:15:00", *overrides, env=env)
    job_dir = str(tmp_path / "slurmjob")
    started = time.monotonic()
    submitted = slurm_cluster.run("bash", str(scripts / "submit.sh"), env=env)
    learner = re.search(r"learner job (\d+) submitted", submitted).group(1)
    array = re.search(r"Submitted batch job (\d+)", submitted).group(1)
    wait = lambda what, check, timeout_s=300: wait_for(what, check, timeout_s, slurm_cluster, job_dir)  # noqa: E731

    wait(f"array task {array}_1 running", lambda: slurm_cluster.state(f"{array}_1") == "RUNNING")
    assert "NumCPUs=2 " in slurm_cluster.run("scontrol", "show", "job", "-o", f"{array}_1")  # --cpus-per-generator
    slurm_cluster.run("scancel", f"{array}_1")
    wait("the first trained step", lambda: steps_done(job_dir) >= 1)  # gen-0 trains the job on
    first_step_s = time.monotonic() - started
    assert slurm_cluster.state(f"{array}_0") == "RUNNING" and slurm_cluster.state(learner) == "RUNNING"
    slurm_cluster.run("scancel", f"{array}_0")  # no generator left: the learner waits
    # COMPLETING until its processes are gone: a generator that ignored scancel's SIGTERM lasts KillWait (30 s)
    wait(f"array task {array}_0 cancelled and gone", lambda: slurm_cluster.state(f"{array}_0") == "CANCELLED", 20)
    cancelled_at = steps_done(job_dir)
    assert slurm_cluster.state(f"{array}_1") == "CANCELLED"
    assert slurm_cluster.state(learner) == "RUNNING", f"gen-0 trained on after its scancel: {cancelled_at} steps"
    assert cancelled_at < STEPS // 2, f"gen-0 trained {cancelled_at} of {STEPS} steps before its cancel: slow it"
    late = re.search(r"(\d+)", slurm_cluster.run("sbatch", "--parsable", "--array=2",
                                                 f"--export=ALL,LEARNER_JOB_ID={learner}", "generators.sbatch",
                                                 env=env, cwd=str(scripts))).group(1)
    wait("the learner job's end", lambda: slurm_cluster.state(learner) not in ("PENDING", "RUNNING"), 300)
    end_s = time.monotonic() - started
    wait(f"the late generator {late}_2's end", lambda: slurm_cluster.state(f"{late}_2") not in ("PENDING",
                                                                                                "RUNNING"), 60)
    print(f"\nslurm tiny job ({STEPS} steps): first trained step {first_step_s:.1f} s after submit.sh, "
          f"job end {end_s:.1f} s; gen-0 trained {cancelled_at} steps, the late gen-2 the others")

    assert slurm_cluster.state(learner) == "COMPLETED"
    assert [row["step"] for row in read_progress(job_dir)] == list(range(1, STEPS + 1))
    summary = json.loads(open(os.path.join(job_dir, "summary.json")).read())
    assert summary["steps"] == STEPS and {"gen-0", "gen-2"} <= set(summary["generators"])
    assert slurm_cluster.state(f"{late}_2") == "COMPLETED"  # the generator leaves when the job ends, cleanly
    completion = slurm_cluster.run("sacct", "--completion", "-n", "-P", "-o", "JobID,State", "-j", learner)
    assert completion.split() == [f"{learner}|COMPLETED"], completion
