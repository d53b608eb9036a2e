"""`asyncrl run`: one learner and `--generators N` generators on this machine, supervised.

It builds the demo assets first (so every child finds them cached), starts the learner and the generators (named
gen-0, gen-1, ...) as child processes in their own process groups with logs in the job directory, and draws the
learner's progress line. Ctrl-C or SIGTERM stops them all cleanly. When the learner dies, it reports the exit code and the tail
of its log and stops the generators. A generator that dies is reported the same way; the learner carries on with
the others, and once none is left the job stops. When the learner finishes, each generator gets
`buffer.done_grace_s` to notice and exit (buffer/done.py).
"""
import json
import os
import signal
import subprocess
import sys
import time

from asyncrl.launch.job import JobInputsError, job_dir_for, print_summary, resolve_rl_inputs, say_stderr
from asyncrl.telemetry.progress import format_line
from asyncrl.telemetry.server import TrackingServerError, artifacts_dir_for, start_tracking_server

TAIL_LINES = 25
POLL_S = 0.5


def run_job(cfg, recipe, overrides: list, generators: int = 1, learner_args: list = ()) -> int:
    try:
        resolve_rl_inputs(cfg, require_data=True)
    except JobInputsError as err:
        say_stderr(f"asyncrl run: {err}")
        return 2
    job_dir = os.path.abspath(job_dir_for(cfg.job))
    say_stderr(f"asyncrl run: job directory {job_dir}")
    os.makedirs(job_dir, exist_ok=True)
    children: dict = {}
    server = None  # telemetry.serve's MLflow server: not a generator, so not among the supervised children
    try:
        if cfg.telemetry.serve:  # first: the learner's run lives there
            server, url = tracking_server(cfg.telemetry, job_dir)
            overrides = [*overrides, f"telemetry.tracking_uri={url}", "telemetry.serve=false"]
        children["learner"] = start_child("learner", "learner", recipe, overrides, job_dir, list(learner_args))
        for name in generator_names(cfg.generator.generator_id, generators):
            children[name] = start_child(name, "generator", recipe, [*overrides, f"generator.generator_id={name}"],
                                         job_dir)
        code = supervise(children, job_dir, cfg.buffer.done_grace_s)
    except (KeyboardInterrupt, SystemExit) as stopped:  # Ctrl-C, or SIGTERM (launch/cli.py makes it SystemExit)
        # the children have process groups of their own, so nothing but this reaches them: never leave them behind
        say_stderr("\nasyncrl run: interrupted; stopping the learner and the generators")
        stop_all(children)
        return 130 if isinstance(stopped, KeyboardInterrupt) else 143
    except TrackingServerError as err:
        say_stderr(f"asyncrl run: {err}")
        return 1
    finally:
        if server is not None:  # after the learner ended the run
            stop(server)
    summary_path = os.path.join(job_dir, "summary.json")
    if code == 0 and os.path.isfile(summary_path):
        with open(summary_path) as handle:
            print_summary(json.load(handle))
        print(f"logs: {job_dir}")
        if server is not None:
            print(f"the job's MLflow server has stopped; to look again: mlflow ui --backend-store-uri {server['store']}"
                  f" (from {server['cwd']}), then the charts link with its port")
    return code


def tracking_server(telemetry, job_dir: str) -> tuple:
    """telemetry.serve: the MLflow server on the job's store (telemetry/server.py), as a child, and its URL."""
    from asyncrl.telemetry.mlflow_logger import resolve_tracking_uri

    store = resolve_tracking_uri(telemetry.tracking_uri)
    proc, url = start_tracking_server(store, job_dir, telemetry.serve_host, telemetry.serve_port,
                                      say=say_stderr)
    say_stderr(f"asyncrl run: MLflow tracking server at {url} (store {store}, log {job_dir}/mlflow-server.log)")
    return {"name": "mlflow-server", "proc": proc, "log": os.path.join(job_dir, "mlflow-server.log"), "store": store,
            "cwd": os.path.dirname(artifacts_dir_for(store, job_dir))}, url


def generator_names(configured_id: str, count: int) -> list[str]:
    """gen-0, gen-1, ...: fixed ids, so each generator's sampling seed is the same in every run (generator.seed);
    one generator keeps the id the config gives it."""
    if count == 1 and configured_id:
        return [configured_id]
    return [f"gen-{index}" for index in range(count)]


def start_child(name: str, role: str, recipe, overrides: list, job_dir: str, extra_args: list = ()) -> dict:
    """`role` (learner or generator) as a child in its own process group, logging to <job dir>/<name>.log."""
    command = [sys.executable, "-m", "asyncrl.launch.cli", role, *extra_args,
               *(["--config", recipe] if recipe else []), *overrides, "telemetry.progress=false"]
    log_path = os.path.join(job_dir, f"{name}.log")
    env = {**os.environ, "ASYNCRL_JOB_DIR": job_dir, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # own process group: Ctrl-C reaches only us
    return {"name": name, "proc": proc, "log": log_path}


def supervise(children: dict, job_dir: str, grace_s: float) -> int:
    """Waits for the learner to finish (0), the learner to fail, or the last generator to fail (its exit code)."""
    progress_path = os.path.join(job_dir, "progress.jsonl")
    tty = sys.stderr.isatty()
    last_line, last_print = "", 0.0
    generators = {name: child for name, child in children.items() if name != "learner"}
    failed: set = set()
    while True:
        time.sleep(POLL_S)
        line = latest_progress(progress_path)
        if line and line != last_line and (tty or time.monotonic() - last_print > 10):
            sys.stderr.write(("\r\033[K" + line) if tty else line + "\n")
            sys.stderr.flush()
            last_line, last_print = line, time.monotonic()
        code = children["learner"]["proc"].poll()
        if code == 0:
            if tty:
                sys.stderr.write("\n")
            wait_or_stop(list(generators.values()), grace_s)
            return 0
        if code is not None:
            report_failure(children["learner"], code)
            stop_all(children)
            return code
        for name, child in generators.items():
            code = child["proc"].poll()
            if code in (None, 0) or name in failed:  # 0: it heard "done" first; the learner is finishing up
                continue
            failed.add(name)
            report_failure(child, code)
            if len(failed) == len(generators):
                say = "the last generator" if len(generators) > 1 else "the generator"
                print(f"asyncrl run: {say} failed; stopping the learner", file=sys.stderr)
                stop_all(children)
                return code or 1


def latest_progress(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(path) - 4096))
            record = json.loads(handle.read().decode(errors="ignore").strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return ""
    return format_line(record["step"], record["total"], record, record["elapsed_s"])


def report_failure(child: dict, code: int) -> None:
    role = "learner" if child["name"] == "learner" else f"generator {child['name']}"
    print(f"\nasyncrl run: the {role} exited with code {code}. Last lines of {child['log']}:", file=sys.stderr)
    try:
        with open(child["log"], errors="replace") as handle:
            tail = handle.readlines()[-TAIL_LINES:]
    except OSError:
        tail = ["(log unreadable)\n"]
    sys.stderr.write("".join("  | " + line for line in tail))


def wait_or_stop(children: list, grace_s: float) -> None:
    """Give every child until `grace_s` from now to exit, then stop the ones still running."""
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child["proc"].wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            stop(child)


def stop(child: dict, timeout_s: float = 15.0) -> None:
    """SIGTERM to the child's process group (it and the engine processes it spawned), then SIGKILL."""
    proc = child["proc"]
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def stop_all(children: dict) -> None:
    for child in children.values():
        stop(child)
