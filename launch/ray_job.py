"""`asyncrl ray`: one job on an existing Ray cluster, and `asyncrl ray scale` to resize its generator fleet.

The driver (this module, on the head node or through `ray job submit`) places the learner's ranks together in one
placement group, one `RoleProcess` actor per rank (launch/ray_actors.py), and gives them a torch.distributed
rendezvous from rank 0's actor: its node's address and a port free there (gloo on CPU, NCCL on GPU, as
learner/parallel.py picks). Rank 0's node address is also where generators reach the learner's embedded ZeroMQ
buffer (buffer.host) and its weight servers (weightsync.advertise); with buffer.backend=redis the buffer is the
Redis the recipe names. The generators belong to a `Fleet` actor (launch/ray_fleet.py), named after the job so
that `asyncrl ray scale JOB --generators N` reaches it from any machine.

The driver prints the learner's progress line and the fleet's events, and ends as `asyncrl run` does: when the
learner finishes, the generators get buffer.done_grace_s to hear "done"; when a learner rank fails, everything is
stopped and its log's tail printed. Ray is an optional extra (`asyncrl[ray]`): nothing outside launch/ray_*.py
imports it.
"""
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from asyncrl.launch.job import JobInputsError, job_dir_for, print_summary, resolve_rl_inputs, say_stderr
from asyncrl.launch.ray_actors import RAY_NAMESPACE, RoleProcess, fleet_name
from asyncrl.telemetry.progress import format_line

POLL_S = 1.0
CALL_TIMEOUT_S = 120.0
"""The longest the driver waits for one call to an actor it placed (the learner's ranks, the fleet): a node that
hangs or is cut off fails the job, naming the call, instead of holding the driver forever (Ray's default)."""
PLACEMENT_TIMEOUT_S = 120.0
GCS_DIAL_S = 10.0
DEFAULT_MAX_RESTARTS = 20
"""Restarts Ray gives one generator's actor: enough for preemptions and the odd OOM kill, not a crash loop."""


class RayLaunchError(ValueError):
    """The command line or the cluster cannot run the job (the message says which and what would)."""


@dataclass
class RayLaunch:
    """`asyncrl ray`'s options: how many processes and what each asks Ray for."""
    generators: int = 1
    nproc: int = 1
    """Learner ranks, one actor each, in one placement group."""
    gpus_per_rank: float | None = None
    """None: 1 when the cluster has GPUs, else 0."""
    cpus_per_rank: float = 1.0
    gpus_per_generator: float | None = None
    cpus_per_generator: float = 1.0
    learner_resources: dict = field(default_factory=dict)
    """Custom resources each rank needs, e.g. {"learner_host": 1}: the nodes started with them hold the learner."""
    generator_resources: dict = field(default_factory=dict)
    autoscale: str = ""
    """MIN:MAX: the fleet sizes itself between these (launch/autoscale.py); "" keeps --generators."""
    autoscale_interval_s: float = 30.0
    autoscale_cooldown_s: float = 60.0
    """After a change, the autoscaler waits this long (new engines start first): above the engine's start time."""
    max_restarts: int = DEFAULT_MAX_RESTARTS
    address: str = "auto"


def add_ray_arguments(cmd) -> None:
    cmd.add_argument("--generators", type=int, default=1, help="generators to start (default 1)")
    cmd.add_argument("--nproc", type=int, default=1, help="learner ranks, placed together (default 1)")
    cmd.add_argument("--gpus-per-rank", type=float, default=None,
                     help="GPUs each learner rank asks Ray for (default: 1 when the cluster has GPUs, else 0)")
    cmd.add_argument("--cpus-per-rank", type=float, default=1.0, help="CPUs each learner rank asks for (default 1)")
    cmd.add_argument("--gpus-per-generator", type=float, default=None,
                     help="GPUs each generator asks for (default: 1 when the cluster has GPUs, else 0)")
    cmd.add_argument("--cpus-per-generator", type=float, default=1.0, help="CPUs each generator asks for (default 1)")
    cmd.add_argument("--learner-resources", type=json.loads, default={}, metavar="JSON",
                     help="custom Ray resources per learner rank, e.g. '{\"learner_host\": 1}'")
    cmd.add_argument("--generator-resources", type=json.loads, default={}, metavar="JSON",
                     help="custom Ray resources per generator, e.g. '{\"generator_host\": 1}'")
    cmd.add_argument("--autoscale", default="", metavar="MIN:MAX",
                     help="size the generator fleet from what the job measures, between MIN and MAX")
    cmd.add_argument("--autoscale-interval-s", type=float, default=30.0, help="seconds between autoscale decisions")
    cmd.add_argument("--autoscale-cooldown-s", type=float, default=60.0,
                     help="seconds after a change before the next (longer than a generator takes to start)")
    cmd.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                     help=f"restarts of a generator whose process died (default {DEFAULT_MAX_RESTARTS})")
    cmd.add_argument("--address", default="auto", help="the Ray cluster (default auto: RAY_ADDRESS or the local one)")


def launch_of(args) -> RayLaunch:
    for key in ("learner_resources", "generator_resources"):
        value = getattr(args, key)
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
            raise RayLaunchError(f"--{key.replace('_', '-')} must be a JSON object of resource -> amount, got "
                                 f"{value!r}")
    if args.generators < 1 or args.nproc < 1:
        raise RayLaunchError(f"--generators and --nproc must be >= 1, got {args.generators} and {args.nproc}")
    return RayLaunch(args.generators, args.nproc, args.gpus_per_rank, args.cpus_per_rank, args.gpus_per_generator,
                     args.cpus_per_generator, args.learner_resources, args.generator_resources, args.autoscale,
                     args.autoscale_interval_s, args.autoscale_cooldown_s, args.max_restarts, args.address)


def job_overrides(cfg, learner_ip: str) -> list:
    """What the learner's ranks and every generator must both pass: where the learner is (its rank 0's node)."""
    where = ["weightsync.host=0.0.0.0", f"weightsync.advertise={learner_ip}"]
    if cfg.buffer.backend == "zmq":
        where.append(f"buffer.host={learner_ip}")
    return where


def rank_env(rank: int, world: int, master_ip: str, master_port: int) -> dict:
    """torch.distributed's env:// rendezvous for one rank. LOCAL_RANK is 0: Ray gives each rank's actor its own
    GPU (CUDA_VISIBLE_DEVICES), which is device 0 inside it; it also makes the rank die with its actor."""
    if world == 1:
        return {}
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": master_ip, "MASTER_PORT": str(master_port)}


def cmd_ray(cfg, args) -> int:
    try:
        launch = launch_of(args)
        policy = parse_policy(launch)
        resolve_rl_inputs(cfg, require_data=True)  # the demo assets, built once here (a one-machine cluster)
    except (RayLaunchError, JobInputsError, ValueError) as err:
        say_stderr(f"asyncrl ray: {err}")
        return 2
    try:
        import ray
    except ImportError:
        say_stderr("asyncrl ray: Ray is not installed; pip install 'asyncrl[ray]'")
        return 2
    recipe = ["--config", args.config] if args.config else []
    return run_ray_job(ray, cfg, launch, policy, [*recipe, *args.overrides, "telemetry.progress=false"])


def parse_policy(launch: RayLaunch):
    if not launch.autoscale:
        return None
    from asyncrl.launch.autoscale import parse_autoscale

    policy = dataclasses.replace(parse_autoscale(launch.autoscale, launch.autoscale_interval_s),
                                 cooldown_s=launch.autoscale_cooldown_s)
    if not policy.min_generators <= launch.generators <= policy.max_generators:
        raise RayLaunchError(f"--generators {launch.generators} is outside --autoscale {launch.autoscale}")
    return policy


def join_cluster(ray, address: str, command: str) -> bool:
    """ray.init on an existing cluster; False (after saying why) when there is none at `address`. A host:port is
    dialled first: ray.init retries an address nobody answers for minutes."""
    host, _, port = address.rpartition(":")
    if host and port.isdigit():
        import socket

        try:
            socket.create_connection((host, int(port)), timeout=GCS_DIAL_S).close()
        except OSError as err:
            say_stderr(f"asyncrl {command}: no Ray cluster answers at --address {address} ({err}); start one with "
                       f"`ray start --head`, or pass its address")
            return False
    try:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        say_stderr(f"asyncrl {command}: no Ray cluster at --address {address}: {str(err).splitlines()[0]} (start "
                   f"one with `ray start --head`, or pass its address)")
        return False
    return True


def run_ray_job(ray, cfg, launch: RayLaunch, policy, argv: list) -> int:
    if not join_cluster(ray, launch.address, "ray"):
        return 2
    name = fleet_name(cfg.job.name)
    if name in ray.util.list_named_actors():
        say_stderr(f"asyncrl ray: a job named {cfg.job.name!r} is already running on this cluster; give this one "
                   f"another job.name")
        return 2
    job_dir = os.path.abspath(job_dir_for(cfg.job))
    say_stderr(f"asyncrl ray: job {cfg.job.name} on the Ray cluster at {ray.get_runtime_context().gcs_address}; "
               f"job directory {job_dir} on the learner's node")
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    placement, ranks, fleet = None, [], None
    try:
        placement, ranks = place_learner(ray, launch, has_gpus, argv, job_dir)
        node = ray.get(ranks[0].node.remote(), timeout=CALL_TIMEOUT_S)
        port = ray.get(ranks[0].free_port.remote(), timeout=CALL_TIMEOUT_S)
        shared = job_overrides(cfg, node["ip"])
        if cfg.telemetry.serve:  # the MLflow server on rank 0's node, where the generators reach it
            url = ray.get(ranks[0].serve_tracking.remote(cfg.telemetry.tracking_uri, cfg.telemetry.serve_host,
                                                         cfg.telemetry.serve_port), timeout=CALL_TIMEOUT_S)
            shared += [f"telemetry.tracking_uri={url}", "telemetry.serve=false"]
            say_stderr(f"asyncrl ray: MLflow tracking server at {url} (its log: mlflow-server.log in the job "
                       f"directory)")
        waits = [rank.wait.remote() for rank in ranks]
        for index, rank in enumerate(ranks):
            rank.start.remote(rank_env(index, len(ranks), node["ip"], port), shared)
        say_stderr(f"asyncrl ray: learner ({len(ranks)} rank{'s' * (len(ranks) > 1)}) on {node['ip']}")
        fleet = start_fleet(ray, cfg, launch, policy, [*argv, *shared], job_dir, ranks[0], has_gpus)
        with ctrl_c_flag() as interrupted:
            return supervise(ray, cfg, ranks, waits, fleet, interrupted)
    except KeyboardInterrupt:
        say_stderr("\nasyncrl ray: interrupted; stopping the learner and the generators")
        return 130
    except RayLaunchError as err:
        say_stderr(f"asyncrl ray: {err}")
        return 2
    except ray.exceptions.RayTaskError as err:  # an actor's method failed starting the job (the MLflow server)
        say_stderr(f"asyncrl ray: {str(err.cause if err.cause is not None else err).splitlines()[-1]}")
        return 1
    finally:
        stop_everything(ray, fleet, ranks, placement)


def place_learner(ray, launch: RayLaunch, has_gpus: bool, argv: list, job_dir: str) -> tuple:
    """The ranks' placement group (PACK: on as few nodes as fit) and one actor per bundle; the learner's command
    line gets the shared overrides when `start` is called (they need rank 0's address)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = launch.gpus_per_rank if launch.gpus_per_rank is not None else (1.0 if has_gpus else 0.0)
    bundle = {"CPU": launch.cpus_per_rank, **({"GPU": gpus} if gpus else {}), **launch.learner_resources}
    group = placement_group([dict(bundle) for _ in range(launch.nproc)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RayLaunchError(f"the cluster could not place {launch.nproc} learner rank(s) of {bundle} within "
                             f"{PLACEMENT_TIMEOUT_S:.0f} s: `ray status` shows what it has")
    ranks = []
    for index in range(launch.nproc):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
        actor = ray.remote(RoleProcess).options(
            num_cpus=launch.cpus_per_rank, num_gpus=gpus, resources=dict(launch.learner_resources),
            scheduling_strategy=strategy, max_restarts=0, max_concurrency=4,
        ).remote(f"learner-{index}" if launch.nproc > 1 else "learner", "learner", argv, job_dir, os.getcwd(),
                 False, False)
        ranks.append(actor)
    return group, ranks


def start_fleet(ray, cfg, launch: RayLaunch, policy, argv: list, job_dir: str, learner, has_gpus: bool):
    from asyncrl.launch.ray_fleet import Fleet

    gpus = launch.gpus_per_generator if launch.gpus_per_generator is not None else (1.0 if has_gpus else 0.0)
    options = {"num_cpus": launch.cpus_per_generator, "num_gpus": gpus, "resources": dict(launch.generator_resources),
               "max_restarts": launch.max_restarts}
    fleet = ray.remote(Fleet).options(name=fleet_name(cfg.job.name), namespace=RAY_NAMESPACE, num_cpus=0,
                                      max_concurrency=8).remote(argv, job_dir, os.getcwd(), options,
                                                                launch.generators, learner, policy)
    ray.get(fleet.poll.remote(), timeout=CALL_TIMEOUT_S)  # the constructor ran: the first generators are placed or queued
    return fleet


@contextlib.contextmanager
def ctrl_c_flag():
    """While supervising, Ctrl-C (SIGINT) only sets a flag that the loop reads every POLL_S, and the loop raises
    KeyboardInterrupt itself. Left to Python's default handler, a SIGINT that lands while the main thread is inside
    Ray's ray.wait/ray.get goes through Ray's own signal check, and the driver once ran on through two Ctrl-Cs (a CI
    rehearsal: no "interrupted" line, progress printed for two more minutes). A second Ctrl-C before the loop reads
    the flag (a call to an actor that hangs) raises at once, as Python's handler would; that handler is back once
    the flag is read, so a Ctrl-C during the stop interrupts the stop."""
    event = threading.Event()

    def on_sigint(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


def supervise(ray, cfg, ranks: list, waits: list, fleet, interrupted: threading.Event) -> int:
    """Until the learner's ranks end: the progress line, the fleet's events; then the end of the job. `interrupted`
    set (Ctrl-C) raises KeyboardInterrupt here."""
    tty = sys.stderr.isatty()
    last_line, last_print, seen_events, offset = "", 0.0, 0, 0
    while True:
        if interrupted.is_set():
            raise KeyboardInterrupt
        done, _ = ray.wait(waits, num_returns=len(waits), timeout=POLL_S)
        fresh, offset = ray.get(ranks[0].progress_since.remote(offset), timeout=CALL_TIMEOUT_S)
        if fresh:
            record = fresh[-1]
            line = format_line(record["step"], record["total"], record, record["elapsed_s"])
            if line != last_line and (tty or time.monotonic() - last_print > 10):
                sys.stderr.write(("\r\033[K" + line) if tty else line + "\n")
                last_line, last_print = line, time.monotonic()
        state = ray.get(fleet.poll.remote(), timeout=CALL_TIMEOUT_S)
        events = ray.get(fleet.events_since.remote(seen_events), timeout=CALL_TIMEOUT_S)
        seen_events += len(events)
        for event in events:
            sys.stderr.write(("\n" if tty else "") + f"asyncrl ray: {event}\n")
        failed = {index: code for index, ref in enumerate(waits) if ref in done and (code := ray.get(ref)) != 0}
        if failed:
            index, code = next(iter(failed.items()))
            tail = ray.get(ranks[index].log_tail.remote(), timeout=CALL_TIMEOUT_S)
            say_stderr(f"\nasyncrl ray: learner rank {index} exited with code {code}. Last lines of its log:\n"
                       + "".join("  | " + line for line in tail.splitlines(keepends=True)))
            return code
        if len(done) == len(waits):
            exits = ray.get(fleet.finish.remote(cfg.buffer.done_grace_s),
                            timeout=cfg.buffer.done_grace_s + CALL_TIMEOUT_S)
            for event in ray.get(fleet.events_since.remote(seen_events), timeout=CALL_TIMEOUT_S):
                say_stderr(f"asyncrl ray: {event}")
            summary = ray.get(ranks[0].read_job_file.remote("summary.json"), timeout=CALL_TIMEOUT_S)
            if summary:
                print_summary(json.loads(summary))
            say_stderr(f"asyncrl ray: generators' exit codes {exits}")
            return 0
        if state["live"] == [] and state["failed"]:
            say_stderr("asyncrl ray: every generator failed; stopping the learner")
            return 1


def stop_everything(ray, fleet, ranks: list, placement) -> None:
    """Stop what this job started (its actors' children with them), whatever the ending."""
    if fleet is not None:
        try:
            ray.get(fleet.finish.remote(0.0), timeout=120)
        except Exception:  # the fleet actor is gone: its generator actors went with it
            pass
        ray.kill(fleet, no_restart=True)
    for rank in ranks:
        try:
            ray.get(rank.stop.remote(), timeout=60)
        except Exception:  # the rank's actor is gone, and its child with it (ASYNCRL_DIE_WITH_PARENT)
            pass
        ray.kill(rank, no_restart=True)
    if placement is not None:
        ray.util.remove_placement_group(placement)


def add_scale_parser(sub) -> None:
    cmd = sub.add_parser("scale", help="resize a running job's generator fleet")
    cmd.add_argument("job", help="the job's job.name")
    cmd.add_argument("--generators", type=int, required=True, help="generators the job should have")
    cmd.add_argument("--address", default="auto", help="the Ray cluster (default auto)")


def cmd_ray_scale(argv: list) -> int:
    """`asyncrl ray scale JOB --generators N`: reach the job's fleet actor by name and resize it."""
    import argparse

    parser = argparse.ArgumentParser(prog="asyncrl ray")
    add_scale_parser(parser.add_subparsers(dest="action", required=True))
    args = parser.parse_args(argv)
    if args.generators < 1:
        say_stderr(f"asyncrl ray scale: --generators must be >= 1, got {args.generators}")
        return 2
    try:
        import ray
    except ImportError:
        say_stderr("asyncrl ray scale: Ray is not installed; pip install 'asyncrl[ray]'")
        return 2
    if not join_cluster(ray, args.address, "ray scale"):
        return 2
    try:
        fleet = ray.get_actor(fleet_name(args.job), namespace=RAY_NAMESPACE)
    except ValueError:
        running = [name.removeprefix("asyncrl-fleet-") for name in ray.util.list_named_actors()
                   if name.startswith("asyncrl-fleet-")]
        say_stderr(f"asyncrl ray scale: no running job named {args.job!r} on this cluster (running: "
                   f"{', '.join(running) or 'none'})")
        return 2
    try:
        change = ray.get(fleet.scale.remote(args.generators, "asyncrl ray scale"), timeout=CALL_TIMEOUT_S)
    except ray.exceptions.RayTaskError as err:
        say_stderr(f"asyncrl ray scale: {err.cause if hasattr(err, 'cause') else err}")
        return 1
    print(f"ray scale: {args.job}: {change['before']} -> {change['after']} generators"
          + (f"; started {', '.join(change['added'])}" if change["added"] else "")
          + (f"; stopping {', '.join(change['removed'])}" if change["removed"] else ""))
    return 0
