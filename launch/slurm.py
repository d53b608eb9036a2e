"""`asyncrl slurm`: the sbatch scripts of a job on a SLURM cluster, and the commands a plain multi-host launch runs.

Two jobs, as a cluster schedules them best: the learner on `--learner-nodes` nodes (one `asyncrl learner` per
node through srun, `--nproc` ranks each, static rendezvous on the first node), and the generators as an array
(one `asyncrl generator` per task, any node). They meet in Redis (`buffer.backend=redis`, the one address every
host knows beforehand); a generator gets the weights from the learner's catch-up server, on the learner's first
node, which the generator array finds with `squeue` from the learner's job id. `submit.sh` submits both: the array
starts once the learner job has.

`learner_command` and `generator_command` are the commands themselves; the scripts embed them, the plain
multi-host launch in docs/multinode.md is them with hosts filled in, and the loopback test runs them.
"""
import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field


@dataclass
class Cluster:
    recipe: str | None
    overrides: list = field(default_factory=list)
    redis_url: str = "redis://127.0.0.1:6379/0"
    learner_nodes: int = 1
    gpus_per_node: int = 8
    generators: int = 4
    gpus_per_generator: int = 1
    cpus_per_generator: int = 0
    """CPU cores of each generator task (--cpus-per-task); 0: the cluster's default, often one core, which a
    cgroup-confined engine (tokenizing, sampling, the HTTP server) then shares with everything else."""
    nproc: int = 0
    """Learner ranks per node; 0: one per GPU (--gpus-per-node), or 1 on a node without GPUs."""
    exclusive: bool = True
    """The learner's nodes to itself (--exclusive); False lets generators share its nodes (a one-node cluster)."""
    master_port: int = 29500
    time: str = "24:00:00"
    partition: str = ""
    job_name: str = "asyncrl"
    job_dir: str = "runs/asyncrl"
    program: tuple = ("asyncrl",)
    """How to start asyncrl on the nodes (`python -m asyncrl.launch.cli` works as well)."""


def shared_overrides(cluster: Cluster, learner_host: str) -> list:
    """What the learner and every generator must both pass (the job's shared config)."""
    return [*cluster.overrides, "buffer.backend=redis", f"buffer.redis.url={cluster.redis_url}",
            "weightsync.host=0.0.0.0", f"weightsync.advertise={learner_host}"]


def ranks_per_node(cluster: Cluster) -> int:
    return cluster.nproc or cluster.gpus_per_node or 1


def learner_command(cluster: Cluster, node_rank: int, learner_host: str) -> list:
    recipe = ["--config", cluster.recipe] if cluster.recipe else []
    return [*cluster.program, "learner", "--nnodes", str(cluster.learner_nodes), "--node-rank", str(node_rank),
            "--nproc", str(ranks_per_node(cluster)), "--master-addr", learner_host, "--master-port",
            str(cluster.master_port), *recipe, *shared_overrides(cluster, learner_host)]


def generator_command(cluster: Cluster, index, learner_host: str) -> list:
    recipe = ["--config", cluster.recipe] if cluster.recipe else []
    return [*cluster.program, "generator", *recipe, *shared_overrides(cluster, learner_host),
            f"generator.generator_id=gen-{index}"]


def _shell(command: list, variables: dict) -> str:
    """The command for bash: each argument quoted, a placeholder in `variables` replaced by its shell variable
    (that argument in double quotes, so the variable expands and nothing else does)."""
    words = []
    for word in command:
        word = str(word)
        if not any(placeholder in word for placeholder in variables):
            words.append(shlex.quote(word))
            continue
        escaped = "".join("\\" + char if char in '\\"$`' else char for char in word)
        for placeholder, variable in variables.items():
            escaped = escaped.replace(placeholder, "${" + variable + "}")
        words.append(f'"{escaped}"')
    return " ".join(words)


HOST, RANK, TASK = "@LEARNER_HOST@", "@NODE_RANK@", "@TASK@"


def _header(cluster: Cluster, name: str, log: str, lines: list) -> str:
    partition = [f"#SBATCH --partition={cluster.partition}"] if cluster.partition else []
    return "\n".join(["#!/bin/bash", f"#SBATCH --job-name={cluster.job_name}-{name}", *lines, *partition,
                      f"#SBATCH --time={cluster.time}", f"#SBATCH --output={cluster.job_dir}/{log}",
                      "set -euo pipefail",
                      f"export ASYNCRL_JOB_DIR={shlex.quote(cluster.job_dir)}", ""])


def learner_sbatch(cluster: Cluster) -> str:
    command = _shell(learner_command(cluster, RANK, HOST), {HOST: "LEARNER_HOST", RANK: "SLURM_NODEID"})
    # sed, not head: under pipefail, head exiting early would kill the script with SIGPIPE
    body = ['LEARNER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
            "export LEARNER_HOST",
            "# one learner per node; each starts --nproc ranks under torchrun and meets the others on the first node",
            f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c {shlex.quote('exec ' + command)}", ""]
    # no --gpus line on a node without GPUs: SLURM refuses a GPU request where no gpu GRES is configured
    gpus = [f"#SBATCH --gpus-per-node={cluster.gpus_per_node}"] if cluster.gpus_per_node else []
    exclusive = ["#SBATCH --exclusive"] if cluster.exclusive else []
    return _header(cluster, "learner", "learner-%j.log", [
        f"#SBATCH --nodes={cluster.learner_nodes}", "#SBATCH --ntasks-per-node=1", *gpus, *exclusive]) \
        + "\n".join(body)


def generator_sbatch(cluster: Cluster) -> str:
    command = _shell(generator_command(cluster, TASK, HOST), {HOST: "LEARNER_HOST", TASK: "SLURM_ARRAY_TASK_ID"})
    body = [': "${LEARNER_JOB_ID:?submit with --export=ALL,LEARNER_JOB_ID=<the learner job id> (submit.sh does)}"',
            "# the learner's first node runs its catch-up server",
            'LEARNER_HOST=$(scontrol show hostnames "$(squeue -j "$LEARNER_JOB_ID" -h -o %N)" | sed -n 1p)',
            f"exec {command}", ""]
    gpus = [f"#SBATCH --gpus={cluster.gpus_per_generator}"] if cluster.gpus_per_generator else []
    cpus = [f"#SBATCH --cpus-per-task={cluster.cpus_per_generator}"] if cluster.cpus_per_generator else []
    return _header(cluster, "generators", "gen-%a-%A.log", [
        f"#SBATCH --array=0-{cluster.generators - 1}", "#SBATCH --ntasks=1", *gpus, *cpus]) + "\n".join(body)


def submit_script(cluster: Cluster) -> str:
    return "\n".join(["#!/bin/bash", "# submits the learner, then the generator array once the learner has started",
                      "set -euo pipefail", f"mkdir -p {shlex.quote(cluster.job_dir)}  # SLURM writes the logs there",
                      'cd "$(dirname "$0")"', "LEARNER_JOB_ID=$(sbatch --parsable learner.sbatch)",
                      'sbatch --dependency=after:"$LEARNER_JOB_ID" --export=ALL,LEARNER_JOB_ID="$LEARNER_JOB_ID" '
                      "generators.sbatch", 'echo "learner job $LEARNER_JOB_ID submitted, generators after it"', ""])


def write_scripts(cluster: Cluster, out_dir: str) -> list:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, text in (("learner.sbatch", learner_sbatch(cluster)), ("generators.sbatch", generator_sbatch(cluster)),
                       ("submit.sh", submit_script(cluster))):
        path = os.path.join(out_dir, name)
        with open(path, "w") as handle:
            handle.write(text)
        os.chmod(path, 0o755)
        paths.append(path)
    return paths


def add_slurm_arguments(cmd) -> None:
    cmd.add_argument("--out", required=True, help="directory to write learner.sbatch, generators.sbatch, submit.sh")
    cmd.add_argument("--redis-url", required=True, help="the Redis every host reaches (buffer.redis.url)")
    cmd.add_argument("--learner-nodes", type=int, default=1)
    cmd.add_argument("--gpus-per-node", type=int, default=8,
                     help="GPUs of each learner node (0: a node without GPUs, no GPU request)")
    cmd.add_argument("--nproc", type=int, default=0,
                     help="learner ranks per node (default: one per GPU; 1 with --gpus-per-node 0)")
    cmd.add_argument("--generators", type=int, default=4, help="generator array size")
    cmd.add_argument("--gpus-per-generator", type=int, default=1, help="0: generators on CPUs, no GPU request")
    cmd.add_argument("--cpus-per-generator", type=int, default=0,
                     help="CPU cores per generator task (--cpus-per-task; default: the cluster's default)")
    cmd.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=True,
                     help="the learner's nodes to itself (default); --no-exclusive lets generator tasks share them")
    cmd.add_argument("--master-port", type=int, default=29500, help="the learner's rendezvous port on its first node")
    cmd.add_argument("--time", default="24:00:00")
    cmd.add_argument("--partition", default="")


def cmd_slurm(cfg, args) -> int:
    if min(args.learner_nodes, args.generators) < 1 or min(args.gpus_per_node, args.gpus_per_generator,
                                                           args.cpus_per_generator, args.nproc) < 0:
        print("asyncrl slurm: --learner-nodes and --generators must be >= 1; --gpus-per-node, --gpus-per-generator, "
              "--cpus-per-generator and --nproc >= 0", file=sys.stderr)
        return 2
    cluster = Cluster(recipe=args.config, overrides=list(args.overrides), redis_url=args.redis_url,
                      learner_nodes=args.learner_nodes, gpus_per_node=args.gpus_per_node, generators=args.generators,
                      gpus_per_generator=args.gpus_per_generator, cpus_per_generator=args.cpus_per_generator,
                      nproc=args.nproc, exclusive=args.exclusive,
                      master_port=args.master_port, time=args.time,
                      partition=args.partition, job_name=cfg.job.name,
                      job_dir=os.path.abspath(os.path.join(cfg.job.out_dir, cfg.job.name)))
    for path in write_scripts(cluster, args.out):
        print(path)
    print(f"submit with: bash {os.path.join(args.out, 'submit.sh')}")
    return 0
