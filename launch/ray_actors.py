"""What `asyncrl ray` runs on the cluster's nodes: one actor per asyncrl process, and the fleet that owns the
generators.

Each learner rank and each generator is an `asyncrl learner` / `asyncrl generator` child process of a Ray actor
(`RoleProcess`), started exactly as `asyncrl run` starts it. A child, not the actor's own process: the command keeps
its main thread (signal handlers: SIGTERM stops a generator between groups, its dealt prompts going back to the
epoch), its event loop and its environment, and a Ray worker's threads and logging stay out of it. The child dies
with its actor (ASYNCRL_DIE_WITH_PARENT, launch/job.py::die_with_parent), so Ray never restarts an actor beside a
leftover child.

A generator whose process dies (SIGKILL, the OOM killer) takes its actor down with it (`wait` exits the actor's
process): Ray restarts the actor (`max_restarts`), whose constructor starts the generator again, and retries the
pending `wait`; the generator rejoins through the learner's catch-up path. A generator that exits with a code of
its own (refused by the learner, a recipe error) is reported, never restarted: the restart would fail alike.

`Fleet` is a named actor (`fleet_name(job)`, namespace "asyncrl") so that `asyncrl ray scale` from any machine
reaches it. It creates and stops generator actors, and, with an autoscale policy, sizes the fleet from the
learner's progress records (launch/autoscale.py). Ray is imported inside functions: this module is imported by
the driver only after `ray` is known to be installed.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time

RAY_NAMESPACE = "asyncrl"
CHILD_STOP_S = 15.0
"""SIGTERM, then this long before SIGKILL: a generator says bye (its deals go back) well within it."""


def fleet_name(job_name: str) -> str:
    return f"asyncrl-fleet-{job_name}"


def child_cwd(driver_cwd: str) -> str:
    """Where the child runs: the job's working directory when it was submitted with one (`ray job submit
    --working-dir`: Ray unpacks it on each node and starts the actor in it), else the driver's directory when this
    node has it (a shared filesystem, or the driver's own node), else the actor's."""
    import ray

    if (ray.get_runtime_context().runtime_env or {}).get("working_dir"):
        return os.getcwd()
    return driver_cwd if os.path.isdir(driver_cwd) else os.getcwd()


class RoleProcess:
    """One `asyncrl <role>` process under a Ray actor. A generator's child starts with the actor (so a restarted
    actor starts it again); a learner rank's waits for `start`, which carries the rendezvous every rank needs."""

    def __init__(self, name: str, role: str, argv: list, job_dir: str, driver_cwd: str, restart_on_death: bool,
                 start_now: bool):
        self.name, self.role, self.argv = name, role, list(argv)
        self.job_dir, self.driver_cwd = job_dir, driver_cwd
        self.restart_on_death = restart_on_death
        self.proc = None
        self.tracking = None  # telemetry.serve's MLflow server, on rank 0's node
        self.stopping = False
        self.lock = threading.Lock()
        os.makedirs(job_dir, exist_ok=True)
        self.log_path = os.path.join(job_dir, f"{name}.log")
        if start_now:
            self.start({}, [])

    def node(self) -> dict:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    def free_port(self) -> int:
        """A port free on this node now (the rank-0 rendezvous)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def start(self, env: dict, extra_argv: list) -> int:
        """Start the child (once), `extra_argv` after the actor's own; returns its PID."""
        with self.lock:
            if self.proc is None:
                child_env = {**os.environ, **env, "ASYNCRL_JOB_DIR": self.job_dir, "PYTHONUNBUFFERED": "1",
                             "ASYNCRL_DIE_WITH_PARENT": "1"}
                command = [sys.executable, "-m", "asyncrl.launch.cli", self.role, *self.argv, *extra_argv]
                with open(self.log_path, "ab") as log_file:
                    log_file.write(f"--- {self.name} started by Ray actor pid {os.getpid()} on node "
                                   f"{self.node()['node_id']} at {time.strftime('%H:%M:%S')}\n".encode())
                    log_file.flush()
                    self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=child_env,
                                                 cwd=child_cwd(self.driver_cwd), start_new_session=True)
            return self.proc.pid

    def serve_tracking(self, tracking_uri: str, host: str, port: int) -> str:
        """telemetry.serve: the MLflow tracking server on this node (rank 0's), on the job's store as this node
        resolves it; its URL. A loopback `host` (the default) binds this node's address instead: the generators
        are on other nodes."""
        import ray

        from asyncrl.telemetry.mlflow_logger import resolve_tracking_uri
        from asyncrl.telemetry.server import LOOPBACK, start_tracking_server

        if host in LOOPBACK:
            host = ray.util.get_node_ip_address()
        cwd = os.getcwd()
        # a relative sqlite store resolves where the learner runs (called before the learner starts, while nothing
        # else runs on this actor)
        os.chdir(child_cwd(self.driver_cwd))
        try:
            store = resolve_tracking_uri(tracking_uri)
        finally:
            os.chdir(cwd)
        self.tracking, url = start_tracking_server(store, self.job_dir, host, port, say=lambda line: None)
        return url

    def child_pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def wait(self) -> int:
        """The child's exit code. A child killed by a signal nobody sent through `stop` takes this actor down, so
        that Ray restarts it (a generator's actor has max_restarts; a learner rank's has none and fails the job)."""
        while self.proc is None:
            time.sleep(0.2)
        code = self.proc.wait()
        if code < 0 and not self.stopping and self.restart_on_death:
            with open(self.log_path, "ab") as log_file:
                log_file.write(f"--- {self.name}: killed by signal {-code}; Ray restarts it\n".encode())
            os._exit(1)
        return code

    def stop(self, timeout_s: float = CHILD_STOP_S):
        """SIGTERM (a generator finishes its step and says bye), then SIGKILL, as `asyncrl run` stops its children
        (launch/supervisor.py); the exit code, None if never started. An MLflow server this actor runs stops after
        its child: the learner ends the run first."""
        from asyncrl.launch.supervisor import stop as stop_child

        self.stopping = True
        if self.proc is not None:
            stop_child({"proc": self.proc}, timeout_s)
        if self.tracking is not None:
            stop_child({"proc": self.tracking})
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return "(log unreadable)\n"

    def read_job_file(self, name: str) -> str:
        """A file of the job directory on this node (rank 0: summary.json), "" when there is none."""
        try:
            with open(os.path.join(self.job_dir, name), errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def append_record(self, name: str, record: dict) -> None:
        """One JSON line into a file of the job directory on this node (the fleet's autoscale.jsonl, on rank 0's
        node beside progress.jsonl)."""
        with open(os.path.join(self.job_dir, name), "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def progress_since(self, offset: int) -> tuple:
        """(the records appended to job_dir/progress.jsonl, rank 0's, after byte `offset`; the offset to ask from
        next). Each call reads only what is new (the driver asks every second, on the learner's node); a line still
        being written is left for the next call."""
        try:
            with open(os.path.join(self.job_dir, "progress.jsonl"), "rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except OSError:  # no progress.jsonl yet: no step has finished
            return [], offset
        complete = data[:data.rfind(b"\n") + 1]
        records = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
        return records, offset + len(complete)
