"""`telemetry.serve`: the job's MLflow tracking server, for generators on other hosts.

A sqlite store is a file on the learner's machine; a generator elsewhere cannot log into it. With `telemetry.serve`
`asyncrl run` starts `mlflow server` on the job's store (artifacts proxied into the job directory), everything
logs through it over HTTP, and the learner publishes its address in the run info that generators receive at
hello. It binds to 127.0.0.1 unless `telemetry.serve_host` says otherwise. MLflow's server authenticates no one,
so binding it to a public interface is said at start.
"""
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
PRIVATE_HOSTS = ("10.*", "172.*", "192.168.*")
"""MLflow's own default for allowed Host headers besides localhost, kept when another name is added."""


class TrackingServerError(RuntimeError):
    pass


def pick_port(host: str) -> int:
    """A port free on `host` now (another process could take it before the server binds: rare, and the server
    then fails to start with the reason in its log)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def advertised_host(bind_host: str) -> str:
    """The name other hosts reach the server by: the bind address, or this machine's name for a wildcard bind."""
    return socket.getfqdn() if bind_host in ("0.0.0.0", "::", "") else bind_host


def server_command(backend_uri: str, artifacts_dir: str, host: str, port: int, advertised: str) -> list:
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri,
               "--artifacts-destination", artifacts_dir, "--host", host, "--port", str(port), "--workers", "1"]
    if advertised not in LOOPBACK:  # MLflow refuses unknown Host headers (DNS rebinding): allow the one we publish
        names = [advertised, f"{advertised}:{port}", *(f"{name}{suffix}" for name in ("localhost", "127.0.0.1")
                                                       for suffix in ("", f":{port}")), *PRIVATE_HOSTS]
        command += ["--allowed-hosts", ",".join(names)]
    return command


def server_env() -> dict:
    """The server's environment: MLflow's job execution off unless the user turned it on. It runs a job runner
    and Huey consumers (worker pools for GenAI evaluation and trace jobs) beside the server, on the cores the
    learner and the generators share, for features a training job's run never uses."""
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION",
                                                                              "false")}


def artifacts_dir_for(backend_uri: str, job_dir: str) -> str:
    """Where the server keeps the artifacts it proxies: beside a sqlite store, where a later `mlflow ui` run from
    the store's directory looks by default (./mlartifacts), so the plots stay viewable after the job; else in the
    job directory."""
    if backend_uri.startswith("sqlite:///"):
        return os.path.join(os.path.dirname(backend_uri[len("sqlite:///"):]) or ".", "mlartifacts")
    return os.path.join(job_dir, "mlartifacts")


def start_tracking_server(backend_uri: str, job_dir: str, host: str, port: int, timeout_s: float = 120.0,
                          say=print) -> tuple:
    """(process, url): the server, up and answering /health. Its log is job_dir/mlflow-server.log."""
    port = port or pick_port(host)
    advertised = advertised_host(host)
    artifacts_dir = artifacts_dir_for(backend_uri, job_dir)
    log_path = os.path.join(job_dir, "mlflow-server.log")
    if host not in LOOPBACK:
        say(f"asyncrl run: the MLflow tracking server listens on {host}:{port}; it has no authentication, so anyone "
            f"who reaches that address can read and write the run (telemetry.serve_host=127.0.0.1 keeps it local)")
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(server_command(backend_uri, artifacts_dir, host, port, advertised),
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=server_env())
    url = f"http://{advertised}:{port}"
    health = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TrackingServerError(f"the MLflow tracking server exited with {proc.returncode}: "
                                      f"{_tail(log_path)}")
        try:
            with urllib.request.urlopen(health, timeout=2) as reply:
                if reply.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # never started: nothing to shut down cleanly
    proc.wait()
    raise TrackingServerError(f"the MLflow tracking server did not answer {health} within {timeout_s:.0f} s: "
                              f"{_tail(log_path)}")


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as handle:
            return " | ".join(handle.read().splitlines()[-lines:])
    except OSError:
        return "(no log)"
