"""`asyncrl slurm`: the sbatch scripts run under bash with stand-ins for SLURM's commands (sbatch, srun, scontrol,
squeue: there is no cluster here) and for `asyncrl`, each recording its arguments; the commands the scripts
produce must be exactly `learner_command` and `generator_command` with the hosts filled in, which the loopback
multi-node test runs for real (tests/e2e/test_multinode.py). tests/integration/test_slurm_real.py submits the
scripts to a real one-node SLURM."""
import json
import os
import stat
import subprocess
import sys

from asyncrl.launch.slurm import Cluster, generator_command, learner_command, learner_sbatch, write_scripts

SHIMS = {
    # srun: run the task once per node, as SLURM does with --ntasks-per-node=1, with that node's SLURM_NODEID
    "srun": 'while [[ "$1" == --* ]]; do shift; done\n'
            'for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@"; done',
    "scontrol": 'echo "$@" >> "$RECORD/scontrol"; echo node-a; echo node-b',
    "squeue": 'echo "$@" >> "$RECORD/squeue"; echo "node-[a-b]"',
    "sbatch": 'echo "$@" >> "$RECORD/sbatch"; [[ "$1" == --parsable ]] && echo 4242 || true',
    "asyncrl": 'python3 -c "import json,sys; print(json.dumps(sys.argv[1:]))" "$@" >> "$RECORD/asyncrl"',
}


def install_shims(bin_dir):
    bin_dir.mkdir()
    for name, body in SHIMS.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\nset -eu\n" + body + "\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_script(path, tmp_path, **env):
    record = tmp_path / "record"
    record.mkdir(exist_ok=True)
    full_env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "RECORD": str(record), **env}
    out = subprocess.run(["bash", str(path)], env=full_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    calls = (record / "asyncrl").read_text().splitlines() if (record / "asyncrl").exists() else []
    return [json.loads(line) for line in calls], record


def test_the_sbatch_scripts_run_one_learner_per_node_and_one_generator_per_task(tmp_path):
    install_shims(tmp_path / "bin")
    cluster = Cluster(recipe="my recipe.yaml", overrides=["learner.lr=1e-6", "data.train_files=[a b.parquet]"],
                      redis_url="redis://:pw@redis.example:6379/0", learner_nodes=2, gpus_per_node=4, generators=3,
                      job_dir=str(tmp_path / "job dir"))
    learner, generators, submit = write_scripts(cluster, str(tmp_path / "scripts"))
    expected = [cmd[1:] for cmd in (learner_command(cluster, 0, "node-a"), learner_command(cluster, 1, "node-a"))]
    calls, _ = run_script(learner, tmp_path, SLURM_NNODES="2", SLURM_JOB_NODELIST="node-[a-b]")
    assert calls == expected  # one learner per node, node ranks 0 and 1, both meeting on the first node
    assert calls[1][calls[1].index("--node-rank") + 1] == "1" and "weightsync.advertise=node-a" in calls[0]
    (tmp_path / "record" / "asyncrl").unlink()
    calls, record = run_script(generators, tmp_path, SLURM_ARRAY_TASK_ID="2", LEARNER_JOB_ID="4242")
    assert calls == [generator_command(cluster, 2, "node-a")[1:]]
    assert "-j 4242" in (record / "squeue").read_text()  # found the learner's node from its job id
    missing = subprocess.run(["bash", str(generators)], env={**os.environ, "PATH": f"{tmp_path / 'bin'}:"
                             f"{os.environ['PATH']}", "RECORD": str(record), "SLURM_ARRAY_TASK_ID": "0"},
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "LEARNER_JOB_ID" in missing.stderr
    _, record = run_script(submit, tmp_path)
    sbatch = (record / "sbatch").read_text().splitlines()
    assert sbatch == ["--parsable learner.sbatch",
                      "--dependency=after:4242 --export=ALL,LEARNER_JOB_ID=4242 generators.sbatch"]
    assert (tmp_path / "job dir").is_dir()  # SLURM does not create the log directory itself
    text = open(generators).read()
    assert "#SBATCH --array=0-2" in text and "#SBATCH --gpus=1" in text
    assert "#SBATCH --nodes=2" in open(learner).read()


def test_asyncrl_slurm_writes_the_scripts_and_refuses_bad_sizes(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "slurm", "--out", str(tmp_path / "s"),
                          "--redis-url", "redis://r:6379/0", "--learner-nodes", "2", "--generators", "8",
                          "learner.lr=2e-6"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(tmp_path / "s")) == ["generators.sbatch", "learner.sbatch", "submit.sh"]
    assert "learner.lr=2e-6" in (tmp_path / "s" / "generators.sbatch").read_text()
    bad = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "slurm", "--out", str(tmp_path / "t"),
                          "--redis-url", "redis://r:6379/0", "--generators", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and ">= 1" in bad.stderr
    negative = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "slurm", "--out", str(tmp_path / "u"),
                               "--redis-url", "redis://r:6379/0", "--gpus-per-node", "-1"], capture_output=True,
                              text=True, timeout=120)
    assert negative.returncode == 2 and ">= 0" in negative.stderr


def test_a_cpu_cluster_gets_no_gpu_request_and_may_share_the_learner_node(tmp_path):
    """Without GPUs (SLURM refuses --gpus where no gpu GRES is configured: tests/integration/test_slurm_real.py
    runs such a cluster), one learner rank per node unless --nproc says otherwise; --no-exclusive lets generator
    tasks run beside the learner, as on a one-node cluster."""
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "slurm", "--out", str(tmp_path / "s"),
                          "--redis-url", "redis://r:6379/0", "--gpus-per-node", "0", "--gpus-per-generator", "0",
                          "--no-exclusive", "--cpus-per-generator", "3", "buffer.redis.namespace=mine"],
                         capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr  # a Redis override is checked as the jobs run it: on buffer.backend=redis
    learner = (tmp_path / "s" / "learner.sbatch").read_text()
    generators = (tmp_path / "s" / "generators.sbatch").read_text()
    assert "--gpus" not in learner + generators and "--exclusive" not in learner
    assert "--nproc 1 " in learner and "buffer.redis.namespace=mine" in generators
    assert "#SBATCH --cpus-per-task=3" in generators and "--cpus-per-task" not in learner
    cluster = Cluster(recipe=None, gpus_per_node=4, nproc=2)
    command = learner_command(cluster, 0, "node-a")
    assert command[command.index("--nproc") + 1] == "2"
    assert "#SBATCH --exclusive" in learner_sbatch(cluster) and "#SBATCH --gpus-per-node=4" in learner_sbatch(cluster)
