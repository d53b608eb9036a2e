"""What a job's commands share, whether the CLI runs them in this process or `asyncrl run` supervises them as
children: the job directory, the job's model and data (the demo's assets or the configured paths), the learner's
ranks, and what is printed to the console.

It sits below both `launch/cli.py` and `launch/supervisor.py`, so neither imports the other. Only the stdlib is
imported at module level: torch, the demo builder and MLflow come inside the functions that need them, after the
command line is parsed.
"""
import os
import sys
import time


def say_stderr(message: str) -> None:
    """Progress and status lines: on stderr, so a command's stdout stays its result (YAML, a table, a summary)."""
    print(message, file=sys.stderr, flush=True)


def job_dir_for(job) -> str:
    """ASYNCRL_JOB_DIR when a launcher chose it (torchrun's ranks, `asyncrl run`'s children, SLURM), else a new
    `<job.out_dir>/<job.name>-<time>-<pid>` (`job`: the job section); created."""
    path = os.environ.get("ASYNCRL_JOB_DIR") or os.path.join(
        job.out_dir, f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


class JobInputsError(ValueError):
    """The job's model or data is not given (and the demo, which would give them, is off)."""


def resolve_rl_inputs(cfg, say=say_stderr, require_data: bool = False) -> tuple[str, list]:
    """The model and prompt files of an RL job: the demo's cached assets (the SFT warm start and its prompts) when
    the demo is active (configs/sections.py::demo_active), else the configured ones. Raises JobInputsError naming
    the missing key: model.path always; data.train_files when the recipe's demo was switched off by a model of the
    user's (the demo's prompts went with it), or with `require_data` (`asyncrl run`, whose generators need data).
    A bare learner may go without: its generators are then scripted clients that bring their own groups."""
    if _demo_applies(cfg, say):
        from asyncrl.launch.demo import prepare_demo

        return prepare_demo(cfg.demo, cfg.job.seed, say)
    _require_model(cfg)
    if (require_data or cfg.demo.task) and cfg.data.source == "files" and not cfg.data.train_files:
        raise JobInputsError("data.train_files is empty: give the job's prompts, e.g. "
                             "data.train_files=[train.parquet] (verl's row format, docs/data.md), or "
                             "data.source=reasoning_gym")
    return cfg.model.path, cfg.data.train_files


def resolve_sft_inputs(cfg, say=say_stderr) -> tuple[str, list]:
    """The model and data of an SFT job: the demo's base model and SFT data when the demo is active, else the
    configured ones, which must then be given. Raises JobInputsError naming the missing key."""
    if _demo_applies(cfg, say):
        from asyncrl.launch.demo import demo_dir, prepare_demo

        prepare_demo(cfg.demo, cfg.job.seed, say)
        root = demo_dir(cfg.demo, cfg.job.seed)
        return os.path.join(root, "base"), [os.path.join(root, "data", "sft.parquet")]
    _require_model(cfg)
    if not cfg.data.train_files:
        raise JobInputsError("data.train_files is empty: give the SFT data, e.g. data.train_files=[chat.parquet] "
                             "(chat `messages` or verl rows, docs/learner.md)")
    return cfg.model.path, cfg.data.train_files


def _demo_applies(cfg, say) -> bool:
    """Whether the demo gives this job its model and data; when the recipe's demo.task is ignored because the job
    brings its own, says so (once: each command resolves its inputs once)."""
    from asyncrl.configs.sections import demo_active, demo_off_note

    note = demo_off_note(cfg.demo, cfg.model, cfg.data)
    if note is not None:
        say(note)
    return demo_active(cfg.demo, cfg.model, cfg.data)


def _require_model(cfg) -> None:
    from asyncrl.configs.sections import own_inputs

    if cfg.model.path is not None:
        return
    given = own_inputs(cfg.model, cfg.data)
    why = (f"this job brings its own data ({', '.join(given)}), so the demo's model is not used" if given else
           "and demo.task is off")
    raise JobInputsError(f"model.path is not set ({why}): give a local HF model directory, e.g. "
                         f"model.path=my-model")


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies: a rank under torchrun's agent (torchrun starts each
    rank in a session of its own, so a `kill -9` of the agent would otherwise leave orphaned ranks holding the
    buffer's port and waiting in collectives), or any process under a Ray actor (launch/ray_actors.py: Ray restarts
    a generator's actor, which must not find the old generator still running)."""
    import ctypes
    import signal

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def join_ranks(learner_cfg, command: str):
    """This process's ParallelState (one plain process, or a rank under torchrun, which then dies with its
    launcher); an exit code instead when the launch does not fit learner.sp_size."""
    from asyncrl.learner.parallel import ParallelConfigError, init_parallel

    if "LOCAL_RANK" in os.environ:
        die_with_parent()
    try:
        return init_parallel(learner_cfg.sp_size, learner_cfg.dist_timeout_s)
    except ParallelConfigError as err:
        print(f"asyncrl {command}: {err}", file=sys.stderr)
        return 2


def leave_ranks(parallel) -> None:
    """On a clean finish every rank waits for the others before the process group is torn down: tearing gloo down
    while a peer is still talking can abort the peer ("terminate called without an active exception")."""
    import torch.distributed as dist

    if parallel.distributed and dist.is_initialized():
        dist.barrier()


def close_ranks() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def locate_job(parallel, resolve, job) -> tuple:
    """(model path, data files, job directory), decided on rank 0 (`resolve()` may build the demo assets) and sent
    to all."""
    from asyncrl.learner.parallel import broadcast_object

    where = (*resolve(), job_dir_for(job)) if parallel.is_main else None
    return broadcast_object(where, parallel)


def run_on_ranks(command: str, learner_cfg, job, resolve, body, errors: tuple) -> int:
    """The shape of every command that runs on the learner's ranks: join the ranks (the learner section's sp_size
    and timeout), locate the job on rank 0 (`resolve()`: its model and data; `job`: the job section), run
    `body(model_path, files, job_dir, parallel)` (its exit code), and close. An error of a type in `errors` (data, a
    checkpoint or keys the job cannot use) is printed naming the command and exits 2. The ranks wait for each other
    only after a clean finish (a failed rank's peers would wait for it forever); the process group is always torn
    down."""
    parallel = join_ranks(learner_cfg, command)
    if isinstance(parallel, int):
        return parallel
    try:
        try:
            model_path, files, job_dir = locate_job(parallel, resolve, job)
            code = body(model_path, files, job_dir, parallel)
        except (JobInputsError, *errors) as err:
            print(f"asyncrl {command}: {err}", file=sys.stderr)
            return 2
        if code == 0:
            leave_ranks(parallel)
        return code
    finally:
        close_ranks()


def exec_torchrun(job, args, module: str, command_name: str) -> int:
    """Replace this process by torchrun running the same command once per rank (returns only on a bad option)."""
    argv = ([f"--config={args.config}"] if args.config else []) + list(args.overrides)
    if module == "asyncrl.launch.cli":
        argv = [command_name, *argv]
    try:
        command = torchrun_command(args, argv, module)
    except ValueError as err:
        print(f"asyncrl {command_name}: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("ASYNCRL_JOB_DIR", job_dir_for(job))  # every rank (and node 0's log) agree on it
    os.execv(sys.executable, command)  # torchrun forwards signals to the ranks and reports a failed one


def torchrun_command(args, argv: list, module: str = "asyncrl.learner") -> list:
    """The torchrun command line that runs this learner command once per rank."""
    import socket

    if args.nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--nproc {args.nproc}, --nnodes {args.nnodes}, --node-rank {args.node_rank}: need "
                         f"nproc >= 1 and 0 <= node-rank < nnodes")
    port = args.master_port
    if not port:
        if args.nnodes > 1:
            raise ValueError("--master-port is required with --nnodes > 1 (every node must use the same one)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
            f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
            f"--master-port={port}", "-m", module, *argv]


def print_summary(summary: dict) -> None:
    """The end of an RL job: the reward of every group the policy sampled from first to last steps, the trained
    groups' beside it, named (dynamic sampling leaves out the groups whose samples all scored alike, so it reads
    higher: telemetry/run_record.py), and where its MLflow run and charts are."""
    from asyncrl.telemetry.overview import run_page_url

    window, steps = summary.get("reward_window_steps"), summary.get("steps")
    for name, label in (("sampled_reward", "reward of every group sampled"),
                        ("trained_reward", "reward of the trained groups")):
        first, last = summary.get(f"{name}_first"), summary.get(f"{name}_last")
        if first is not None:
            print(f"{label}: first {window} steps {first:.3f} -> last {window} steps {last:.3f} ({steps} steps)")
    uri, run_id = summary["mlflow_tracking_uri"], summary["mlflow_run_id"]
    print(f"MLflow: run {run_id} in {uri}")
    if "mlflow_experiment_id" in summary:
        server = uri if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
        page = run_page_url(server, summary["mlflow_experiment_id"], run_id)
        print(f"  charts: {page}" if server == uri else f"  charts: mlflow ui --backend-store-uri {uri}, then {page}")


def print_sft_result(result) -> None:
    """The end of an SFT job: its loss from first to last step and where the model went."""
    losses = result.losses
    if not losses:
        print(f"sft: 0 steps; model saved to {result.out_dir}")
        return
    val = f"validation loss {result.val_losses[-1][1]:.4f}; " if result.val_losses else ""
    print(f"sft: {len(losses)} steps from step {result.start_step}, loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"{val}model saved to {result.out_dir}")
