"""The soak: one job on this machine for a given wall time, a learner, several generators (each in a network
namespace of its own), a rogue generator and, in the Redis variant, a real redis-server, while a seeded schedule
injects faults (bench/soak/schedule.py). Afterwards a checker reads the history the job left (bench/soak/history.py)
and the figures are printed: faults by kind, steps and groups trained, prompts lost and duplicated, the longest step,
the time from each fault to the next trained step, and each process's memory slope and file descriptors
(bench/soak/monitor.py). It fails (exit 1) when the history does not hold, a step takes longer than the stated bound
(every process's stack is dumped first), or a process the soak did not kill exits with an error.

The job is the demo's model on a small slice of its prompts (`--prompts`), so epochs complete often and
exactly-once can be checked over many of them, with dynamic sampling off (a group the generator's filter drops is
consumed without being trained, which the audit trail does not list) and a checkpoint every few steps on a small
tmpfs (the full-disk fault fills it). The job ends when the wall time is up: the learner is stopped (SIGTERM, as an
operator stops it), then the generators, each of which must exit within `STOP_BOUND_S`.

Usage (as root: namespaces, tmpfs):
    python -m asyncrl.bench.soak.run [--minutes 60] [--backend zmq|redis] [--generators 3] [--seed 0]
        [--faults kind=N ...] [--step-bound-s 120] [--work DIR] [--no-netns] [overrides...]
"""
import argparse
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

from asyncrl.bench.soak import history, schedule
from asyncrl.bench.soak.monitor import ProcessMonitor, dump_stacks
from asyncrl.bench.soak.network import SUBNET, SoakNetwork
from asyncrl.bench.soak.rogue import LIAR_KIND

STOP_BOUND_S = 15.0
"""A generator told to stop (SIGTERM) ends within this, its learner alive or not."""
TIERS = {
    "short": {"minutes": 5, "faults": {"kill_generator": 1, "stop_generator": 1, "kill_learner": 1, "kill_redis": 1,
                                       "partition": 1, "slow_link": 1, "kill_during_load": 1, "full_disk": 1,
                                       "hostile": 2},
              "durations": {"stop_generator": 12.0, "partition": 12.0, "slow_link": 12.0, "full_disk": 10.0},
              "lr": 1e-4},
    "hour": {"minutes": 60, "faults": {"kill_generator": 6, "stop_generator": 4, "kill_learner": 4, "kill_redis": 3,
                                       "partition": 4, "slow_link": 4, "kill_during_load": 4, "full_disk": 2,
                                       "hostile": 8},
             "durations": {"stop_generator": 20.0, "partition": 15.0, "slow_link": 20.0, "full_disk": 15.0},
             "lr": 1e-5},
}
"""Each tier's faults, how long each lasting one lasts (seconds): a stop and a partition outlast the soak's Redis
lease (10 s), so the generator's deals go back; and the learning rate. The hour's is a tenth of the demo's: at the
demo's 1e-4 the 64 prompts' sampled reward peaks near step 2,500 (0.33 -> 0.68 in a fault-free run) and then swings
between 0.42 and 0.67 (to step 6,277, fault-free; docs/benchmarks.md, "The soak"), and an hour on one machine runs
9,000-19,000 steps: the soak's check that the reward rose would judge where a swing happened to end, not the
faults."""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Job:
    """The soak's processes: started, killed, restarted, and their logs, by role."""

    def __init__(self, work: str, overrides: list, env: dict, network: SoakNetwork | None, monitor: ProcessMonitor):
        self.work, self.overrides, self.env, self.network, self.monitor = work, overrides, env, network, monitor
        self.procs: dict = {}
        self.killed: set = set()  # roles whose last exit the soak caused
        self.stop_s: dict = {}  # generator -> seconds from SIGTERM to its exit, at the end
        self.learner_lives = 0
        self.exits: list = []  # generators that stopped on their own and were started again

    def start(self, role: str, argv: list, stdin=None) -> subprocess.Popen:
        log = open(os.path.join(self.work, f"{role}.log"), "ab")
        proc = subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=stdin,
                                start_new_session=True)
        log.close()
        self.procs[role] = proc
        self.killed.discard(role)
        self.monitor.watch(role, proc.pid)
        return proc

    def start_learner(self, resume: bool) -> None:
        self.learner_lives += 1
        extra = ["--resume"] if resume else []
        self.start("learner", [sys.executable, "-m", "asyncrl.launch.cli", "learner", *extra, *self.overrides])

    def start_generator(self, role: str) -> None:
        argv = [sys.executable, "-m", "asyncrl.launch.cli", "generator", *self.overrides,
                f"generator.generator_id={role}"]
        self.start(role, self.network.command(role, argv) if self.network else argv)

    def signal(self, role: str, sig: int) -> None:
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.killed.add(role)
        os.killpg(self.procs[role].pid, sig)

    def kill(self, role: str) -> None:
        self.signal(role, signal.SIGKILL)
        self.procs[role].wait()

    def failed(self) -> list:
        """Roles whose process exited on its own with an error (not one the soak killed)."""
        return [f"{role} exited {proc.returncode}" for role, proc in self.procs.items()
                if proc.poll() not in (None, 0) and role not in self.killed]

    def restart_exited_generators(self, generators: list) -> None:
        """A generator that stopped on its own (its learner unreachable for buffer.request_timeout_s, as when a
        request was in flight as the learner was killed) is started again, as Ray or a SLURM array restarts it;
        each exit is kept, with the generator's last line, for the figures."""
        for role in generators:
            proc = self.procs[role]
            if proc.poll() not in (None, 0) and role not in self.killed:
                with open(os.path.join(self.work, f"{role}.log"), errors="replace") as handle:
                    last = [line.strip() for line in handle if line.strip()][-1:]
                self.exits.append({"role": role, "code": proc.returncode, "last_line": last[0] if last else ""})
                self.start_generator(role)

    def pids(self) -> dict:
        return {role: proc.pid for role, proc in self.procs.items() if proc.poll() is None}


class StepWatch(threading.Thread):
    """Polls the learner's progress.jsonl: the wall time each step's row was first seen (for the time from a fault to
    the next trained step), the longest wait between two, and every process's memory through the monitor (every
    `sample_every` polls: a sample walks every process tree)."""

    def __init__(self, job_dir: str, monitor: ProcessMonitor, every_s: float = 0.2, sample_every: int = 5):
        super().__init__(daemon=True)
        self.path, self.monitor, self.every_s = os.path.join(job_dir, "progress.jsonl"), monitor, every_s
        self.sample_every = sample_every
        self.seen: list = []  # (monotonic time, step), one per row, in file order
        self.stop_event = threading.Event()
        self.lines = 0

    def run(self) -> None:
        polls = 0
        while not self.stop_event.wait(self.every_s):
            if polls % self.sample_every == 0:
                self.monitor.sample()
            polls += 1
            if not os.path.exists(self.path):
                continue
            with open(self.path) as handle:
                rows = handle.readlines()
            for line in rows[self.lines:]:
                if line.endswith("\n"):
                    self.seen.append((time.monotonic(), json.loads(line)["step"]))
                    self.lines += 1

    def rows_now(self) -> int:
        """The rows in the file at this moment (read now, not at the last poll)."""
        if not os.path.exists(self.path):
            return 0
        with open(self.path) as handle:
            return sum(1 for line in handle if line.endswith("\n"))

    def quiet_s(self, since: float) -> float:
        """Seconds since the last step was seen (or since `since`, before the first)."""
        last = self.seen[-1][0] if self.seen else since
        return time.monotonic() - last

    def next_step_after(self, moment: float, rows_then: int) -> float | None:
        """Seconds from `moment` to when the first row past the file's first `rows_then` rows was seen: a row
        written before the fault ended (by a learner just killed, say) but polled after it is not a recovery."""
        later = [seen for seen, _ in self.seen[rows_then:] if seen > moment]
        return max(later[0] - moment, 0.0) if later else None


def fill(directory: str) -> str:
    """A file that takes the rest of the filesystem's space (ENOSPC for the next write). Grown a piece at a time to
    the brim: one allocation of the free space measured a moment before failed with ENOSPC when the learner wrote
    in between (the hour soak's driver died of it)."""
    path = os.path.join(directory, "soak-fill")
    piece, size = 1 << 20, 0
    with open(path, "wb") as handle:
        while piece >= 4096:
            try:
                os.posix_fallocate(handle.fileno(), size, piece)
                size += piece
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                piece //= 2
    return path


class Injector:
    """Carries out each fault of the schedule at its time (bench/soak/schedule.py::KINDS)."""

    def __init__(self, job: Job, watch: StepWatch, rogue, redis_server, checkpoints: str):
        self.job, self.watch, self.rogue, self.redis, self.checkpoints = job, watch, rogue, redis_server, checkpoints
        self.events: list = []

    def apply(self, fault) -> None:
        started = time.monotonic()
        job, role = self.job, fault.target
        if fault.kind == "kill_generator":
            job.kill(role)
            time.sleep(2.0)
            job.start_generator(role)
        elif fault.kind == "stop_generator":
            job.signal(role, signal.SIGSTOP)
            time.sleep(fault.duration_s)
            job.signal(role, signal.SIGCONT)
        elif fault.kind == "kill_learner":
            job.kill("learner")
            job.start_learner(resume=True)
        elif fault.kind == "kill_redis":
            self.redis.restart()
        elif fault.kind in ("partition", "slow_link"):
            act = job.network.partition if fault.kind == "partition" else job.network.slow
            act(role, True)
            time.sleep(fault.duration_s)
            act(role, False)
        elif fault.kind == "kill_during_load":  # right as a new version is announced, while the generator loads it
            seen = len(self.watch.seen)
            deadline = time.monotonic() + 30
            while len(self.watch.seen) == seen and time.monotonic() < deadline:
                time.sleep(0.01)
            job.kill(role)
            job.start_generator(role)
        elif fault.kind == "full_disk":
            path = fill(self.checkpoints)
            time.sleep(fault.duration_s)
            os.remove(path)
        elif fault.kind == "hostile":
            self.rogue.stdin.write(b"burst 4\n")
            self.rogue.stdin.flush()
        rows = self.watch.rows_now()  # what was written before the fault ended is not its recovery
        self.events.append({"kind": fault.kind, "target": role, "at_s": fault.at_s, "started": started,
                            "ended": time.monotonic(), "rows": rows})


class RedisServer:
    """redis-server with an append-only file fsynced every write, on the soak's address; restarted on the same
    directory after a SIGKILL, so what it acknowledged survives."""

    def __init__(self, directory: str, host: str, port: int, job: Job):
        self.directory, self.host, self.port, self.job = directory, host, port, job

    def start(self) -> None:
        import redis

        self.job.start("redis", ["redis-server", "--port", str(self.port), "--bind", self.host, "--dir", self.directory,
                                 "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                                 "--maxmemory-policy", "noeviction",
                                 # the bridge's address is not loopback: protected mode would refuse every client, and
                                 # the bridge is this machine's own
                                 "--protected-mode", "no"])
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on {self.host}:{self.port}") from None
                time.sleep(0.05)
        client.close()

    def restart(self) -> None:
        self.job.kill("redis")
        self.start()


def job_overrides(args, data_file: str, model_dir: str, host: str, checkpoints: str, redis_url: str) -> list:
    """The job's settings, the same for every process (the shared sections must hash alike)."""
    overrides = [f"model.path={model_dir}", "demo.task=''", f"data.train_files=[{data_file}]",
                 "learner.total_steps=1000000", f"buffer.host={host}", f"buffer.port={free_port()}",
                 f"weightsync.host={host}",  # the catch-up server too: a generator behind the ring needs it
                 "buffer.max_staleness=1", "buffer.groups_per_step=4", "rollout.n=4", "rollout.max_tokens=10",
                 "algo.dynamic_sampling=false", "generator.engine=hf", "generator.max_inflight_groups=2",
                 "generator.torch_threads=1", "learner.torch_threads=1", "generator.log_every_s=2",
                 "learner.checkpoint_every=5", f"learner.checkpoint_dir={checkpoints}",
                 "buffer.done_grace_s=5", "telemetry.progress=false", "telemetry.plots=false",
                 "telemetry.system_metrics_every_s=0", f"learner.lr={TIERS[args.tier]['lr']}"]
    if args.backend == "redis":
        overrides += ["buffer.backend=redis", f"buffer.redis.url={redis_url}", "buffer.redis.lease_s=10",
                      f"buffer.redis.namespace=soak{uuid.uuid4().hex[:8]}"]
    return [*overrides, *args.overrides]


def prepare_data(work: str, prompts: int, overrides: list) -> tuple[str, str]:
    """(the demo's warm start, a parquet of its first `prompts` training rows); `overrides` may move the demo's
    cache (demo.cache_dir) or its settings."""
    import pyarrow.parquet as pq

    from asyncrl.configs import load_config
    from asyncrl.launch.demo import prepare_demo

    cfg = load_config("demo_cpu.yaml", [o for o in overrides if o.startswith("demo.")])
    model_dir, (train,) = prepare_demo(cfg.demo, cfg.job.seed, say=lambda message: None)
    path = os.path.join(work, "soak.parquet")
    pq.write_table(pq.read_table(train).slice(0, prompts), path)
    return model_dir, path


def mount_tmpfs(path: str, size_mb: int) -> None:
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", path], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"mount tmpfs on {path}: {done.stderr.strip()} (the soak runs as root)")


def recovery_figures(events: list, watch: StepWatch) -> list:
    """Per fault: seconds from its end to the next trained step (None: none came)."""
    return [{**{k: v for k, v in event.items() if k not in ("started", "ended", "rows")},
             "to_next_step_s": watch.next_step_after(event["ended"], event["rows"])} for event in events]


def figures(args, report, events: list, watch: StepWatch, monitor: ProcessMonitor, rogue_records: list,
            failures: list, stop_s: dict, exits: list, learner_lives: int) -> dict:
    """`learner_lives`: the learner processes the soak started. The history sees fewer when a learner resumed right
    after the last step its predecessor recorded (its trained rows follow on without going back)."""
    gaps = [b - a for (a, _), (b, _) in zip(watch.seen, watch.seen[1:])]
    recovery = recovery_figures(events, watch)
    by_kind: dict = {}
    for event in events:
        by_kind[event["kind"]] = by_kind.get(event["kind"], 0) + 1
    liar = [group for group in rogue_records if group["kind"] == LIAR_KIND]
    # a learner resumed from a checkpoint written before the quarantine judges the liar afresh: a window per life
    allowed = args.liar_window * learner_lives
    if report.liar_trained > allowed:
        failures = [*failures, f"the liar had {report.liar_trained} groups trained, more than its quarantine "
                               f"window allows ({args.liar_window} per learner life, {allowed} here)"]
    return {"bench": "soak", "backend": args.backend, "minutes": args.minutes, "seed": args.seed,
            "faults": by_kind, "steps": report.steps, "last_step": report.last_step, "groups": report.groups,
            "learner_lives": learner_lives, "history_lives": len(report.lives),
            "epochs": report.epochs, "prompts_lost": len(report.lost), "prompts_duplicated": len(report.duplicated),
            "stale_trained": len(report.stale), "hostile_sent": len(rogue_records) - len(liar),
            "liar_sent": len(liar), "liar_trained": report.liar_trained,
            "hostile_trained": len(report.hostile_trained), "step_gaps": len(report.gaps),
            "reward_before": report.reward_before, "reward_after": report.reward_after,
            "max_step_s": max(gaps, default=None), "recovery": recovery, "processes": monitor.report(),
            "generator_stop_s": stop_s, "generator_exits": exits, "generator_final_versions": report.final_versions,
            "problems": report.problems() + failures, "ok": not report.problems() and not failures}


def print_figures(result: dict) -> None:
    print(f"soak ({result['backend']}, {result['minutes']} min, seed {result['seed']}): {result['steps']} steps, "
          f"{result['groups']} groups, {result['epochs']} epochs, {result['learner_lives']} learner lives; reward "
          f"{result['reward_before']} -> {result['reward_after']}; longest step {result['max_step_s']} s")
    print("| fault | target | at s | to next step s |\n|---|---|---|---|")
    for row in result["recovery"]:
        print(f"| {row['kind']} | {row['target']} | {row['at_s']:.0f} | {row['to_next_step_s']} |")
    print("| process | lives | RSS start MB | RSS end MB | RSS slope MB/min (last half) | fds start | fds end |\n"
          "|---|---|---|---|---|---|---|")
    for role, p in sorted(result["processes"].items()):
        print(f"| {role} | {p['lives']} | {p['rss_start_mb']} | {p['rss_end_mb']} | {p['rss_slope_mb_per_min']} | "
              f"{p['fds_start']} | {p['fds_end']} |")
    print(f"lost {result['prompts_lost']}, duplicated {result['prompts_duplicated']}, hostile trained "
          f"{result['hostile_trained']} of {result['hostile_sent']} sent, the liar's trained {result['liar_trained']} "
          f"of {result['liar_sent']} sent, stale trained {result['stale_trained']}; the generators ended on "
          f"{', '.join(f'{g} v{v}' for g, v in sorted(result['generator_final_versions'].items()))} (last step "
          f"{result['last_step']})")
    for exit_ in result["generator_exits"]:
        print(f"{exit_['role']} stopped on its own ({exit_['code']}) and was started again: {exit_['last_line']}")
    print("\n".join(result["problems"]) or "the history holds")


def fault_counts(args) -> dict:
    """The tier's faults, the command line's on top; those this run cannot inject are left out (no Redis to kill
    on zmq, no links to cut without namespaces)."""
    counts = {**TIERS[args.tier]["faults"], **dict(args.faults)}
    if args.backend != "redis":
        counts.pop("kill_redis", None)
    if args.no_netns:
        counts.pop("partition", None)
        counts.pop("slow_link", None)
    return {kind: count for kind, count in counts.items() if count > 0}


def stop_all(job: Job, generators: list, rogue) -> list:
    """The operator's stop: the learner (SIGTERM), then each generator, which must end within STOP_BOUND_S."""
    failures = []
    if job.procs["learner"].poll() is None:
        job.signal("learner", signal.SIGTERM)
        try:
            job.procs["learner"].wait(timeout=60)
        except subprocess.TimeoutExpired:
            path = dump_stacks(job.pids(), os.path.join(job.work, "stacks-at-stop.txt"))
            failures.append(f"the learner did not end within 60 s of SIGTERM (every process's stack: {path})")
    for role in generators:
        proc = job.procs[role]
        if proc.poll() is not None:
            continue
        job.signal(role, signal.SIGTERM)
        started = time.monotonic()
        try:
            proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            path = dump_stacks({role: proc.pid}, os.path.join(job.work, f"stacks-{role}-at-stop.txt"))
            failures.append(f"{role} did not end within {STOP_BOUND_S:.0f} s of SIGTERM (its stack: {path})")
        job.stop_s[role] = round(time.monotonic() - started, 2)
    if rogue.poll() is None:
        rogue.stdin.write(b"stop\n")
        rogue.stdin.flush()
        try:
            rogue.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill("rogue")
    return failures


def rogue_records(work: str) -> list:
    with open(os.path.join(work, "rogue.log")) as handle:
        return [json.loads(line) for line in handle if line.startswith("{")]


def vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as handle:
        return int(json.load(handle)["vocab_size"])


def drive(args, job: Job, faults: list, generators: list, job_dir: str, redis) -> tuple:
    """Start everything, inject the faults on time, watch for hangs and crashes, stop. Returns (the fault events,
    the step watch, the rogue's records, failures)."""
    monitor, failures = job.monitor, []
    if redis is not None:
        redis.start()
    job.start_learner(resume=False)
    for role in generators:
        job.start_generator(role)
    rogue = job.start("rogue", [sys.executable, "-m", "asyncrl.bench.soak.rogue", "--vocab",
                                str(vocab_size(args.model_dir)), "--seed", str(args.seed), *job.overrides],
                      stdin=subprocess.PIPE)
    watch = StepWatch(job_dir, monitor)
    watch.start()
    injector = Injector(job, watch, rogue, redis, args.checkpoints)
    started, pending = time.monotonic(), list(faults)
    try:
        while time.monotonic() - started < args.minutes * 60:
            if pending and time.monotonic() - started >= pending[0].at_s:
                fault = pending.pop(0)
                print(f"soak: {time.monotonic() - started:.0f} s: {fault.kind} on {fault.target}", flush=True)
                injector.apply(fault)
            if watch.quiet_s(started) > args.step_bound_s:
                path = dump_stacks(job.pids(), os.path.join(args.work, "stacks.txt"))
                failures.append(f"no step for {args.step_bound_s:.0f} s: every process's stack is in {path}")
                break
            job.restart_exited_generators(generators)
            crashed = job.failed()
            if crashed:
                failures += crashed
                break
            time.sleep(0.2)
        failures += stop_all(job, generators, rogue)
    finally:
        watch.stop_event.set()
        for role, proc in job.procs.items():
            if proc.poll() is None:
                job.kill(role)
    return injector.events, watch, rogue_records(args.work), failures


def soak(args) -> dict:
    import tempfile

    args.work = args.work or tempfile.mkdtemp(prefix="asyncrl-soak-")
    job_dir = os.path.join(args.work, "job")
    os.makedirs(job_dir, exist_ok=True)
    args.model_dir, data = prepare_data(args.work, args.prompts, args.overrides)
    args.checkpoints = os.path.join(args.work, "checkpoints")
    mount_tmpfs(args.checkpoints, args.checkpoint_mb)
    generators = [f"gen-{index}" for index in range(args.generators)]
    network = None if args.no_netns else SoakNetwork(uuid.uuid4().hex[:4], generators, args.subnet)
    try:
        if network is not None:
            network.up()
        host = network.address if network is not None else "127.0.0.1"
        env = {**os.environ, "ASYNCRL_JOB_DIR": job_dir, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "MLFLOW_TRACKING_URI": f"sqlite:///{args.work}/mlflow.db"}
        job = Job(args.work, [], env, network, ProcessMonitor())
        redis = None
        if args.backend == "redis":
            port = free_port()
            os.makedirs(os.path.join(args.work, "redis"), exist_ok=True)
            redis = RedisServer(os.path.join(args.work, "redis"), host, port, job)
        job.overrides = job_overrides(args, data, args.model_dir, host, args.checkpoints,
                                      f"redis://{host}:{redis.port}/0" if redis else "")
        faults = schedule.make_schedule(args.seed, args.minutes * 60, fault_counts(args), generators,
                                        warmup_s=min(60.0, args.minutes * 12), cooldown_s=min(90.0, args.minutes * 15),
                                        durations=TIERS[args.tier]["durations"])
        events, watch, rogue, failures = drive(args, job, faults, generators, job_dir, redis)
    finally:
        if network is not None:
            network.down()
        subprocess.run(["umount", args.checkpoints], capture_output=True)
    report = history.check_history(history.read_jsonl(os.path.join(job_dir, "trained_groups.jsonl")),
                                   history.read_jsonl(os.path.join(job_dir, "progress.jsonl")),
                                   history.data_prompt_ids([data]), max_staleness=1, hostile={"rogue"},
                                   liar="rogue-liar", window=args.window, generators=generators,
                                   final_versions=history.generator_final_versions(env["MLFLOW_TRACKING_URI"],
                                                                                   generators))
    args.liar_window = 8  # learner.quarantine_window_groups, the soak's (the default)
    return figures(args, report, events, watch, job.monitor, rogue, failures, job.stop_s, job.exits,
                   job.learner_lives)


def parse_fault(text: str) -> tuple:
    kind, _, count = text.partition("=")
    if kind not in schedule.KINDS or not count.isdigit():
        raise argparse.ArgumentTypeError(f"--faults wants KIND=N with KIND one of {', '.join(schedule.KINDS)}")
    return kind, int(count)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=sorted(TIERS), default="hour")
    parser.add_argument("--minutes", type=float, default=None, help="wall time (default: the tier's)")
    parser.add_argument("--backend", choices=["zmq", "redis"], default="zmq")
    parser.add_argument("--generators", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=parse_fault, nargs="*", default=[], help="KIND=N on top of the tier's")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per epoch (the first rows of the demo's)")
    parser.add_argument("--step-bound-s", type=float, default=120.0, help="no step for this long is a hang")
    parser.add_argument("--checkpoint-mb", type=int, default=64, help="the checkpoint tmpfs (full_disk fills it)")
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the reward before and after")
    parser.add_argument("--work", default=None)
    parser.add_argument("--no-netns", action="store_true", help="no namespaces: no partition or slow-link faults")
    parser.add_argument("--subnet", default=SUBNET, help="the private /24 of the namespaces, as its first three "
                                                         "octets (another for a second soak beside this one)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    args.minutes = args.minutes or TIERS[args.tier]["minutes"]
    result = soak(args)
    print_figures(result)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
