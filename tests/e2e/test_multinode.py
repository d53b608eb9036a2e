"""The learner on two "nodes" on loopback: the exact commands `asyncrl slurm` writes into its sbatch scripts
(launch/slurm.py: `--nnodes 2`, one rank per node, static rendezvous on the first node's address; Redis between
learner and generator; weights from the catch-up server on 0.0.0.0), with the hosts filled in as 127.0.0.1, each
node a process of its own. The job trains, publishes every version, and the generator samples with them."""
import json
import subprocess
import sys
import time
import uuid

import pytest

from asyncrl.launch.slurm import Cluster, generator_command, learner_command
from tests.conftest import free_port
from tests.e2e.jobs import common_overrides, job_env, read_progress


@pytest.mark.slow
def test_a_learner_on_two_nodes_trains_and_publishes_with_the_slurm_commands(redis_server, tmp_path, demo_assets,
                                                                              demo_cache):
    steps = 4
    overrides = common_overrides(demo_cache, free_port(), steps=steps) + [
        "generator.engine=hf", f"buffer.redis.namespace=nodes{uuid.uuid4().hex[:8]}", "learner.torch_threads=1",
        "algo.dynamic_sampling=false"]  # every group trains: the weak demo model's all-0 groups would starve 4 steps
    cluster = Cluster(recipe=None, overrides=overrides, redis_url=redis_server.url, learner_nodes=2, gpus_per_node=1,
                      master_port=free_port(), program=(sys.executable, "-m", "asyncrl.launch.cli"))
    job_dir = tmp_path / "job"
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir), "OMP_NUM_THREADS": "1"}
    commands = {"node0": learner_command(cluster, 0, "127.0.0.1"), "node1": learner_command(cluster, 1, "127.0.0.1"),
                "gen": generator_command(cluster, 0, "127.0.0.1")}
    procs = {}
    for name, command in commands.items():
        procs[name] = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=open(tmp_path / f"{name}.log", "wb"),
                                       stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 420
        for name in ("node0", "node1", "gen"):
            code = procs[name].wait(timeout=max(deadline - time.monotonic(), 1))
            assert code == 0, f"{name} exited {code}:\n" + (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == steps and "gen-0" in summary["generators"]
    progress = read_progress(job_dir)
    assert [row["step"] for row in progress] == list(range(1, steps + 1))
    assert all(row["timing/weightsync/publish_s"] > 0 for row in progress)  # every version published
    assert max(row["buffer/staleness/max"] for row in progress) <= 1
    from mlflow.tracking import MlflowClient

    params = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(summary["mlflow_run_id"]).data.params
    assert params["learner.world_size"] == "2"  # one rank on each "node", one process group
