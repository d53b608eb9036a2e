"""`asyncrl run`: one learner and one generator on this machine, supervised.

It builds the demo assets first (so both children find them cached), starts the learner and the generator as
child processes in their own process groups with logs in the job directory, and draws the learner's progress
line. Ctrl-C stops both cleanly. When a child dies, it reports the exit code and the tail of its log, and stops the
other. When the learner finishes, the generator gets a grace period to notice and exit.
"""
import json
import os
import signal
import subprocess
import sys
import time

from asyncrl.telemetry.progress import format_line

GRACE_S = 30.0
TAIL_LINES = 25


def run_job(cfg, recipe, overrides: list, learner_args: list = ()) -> int:
    from asyncrl.launch.cli import job_dir_for, print_summary, resolve_model_and_data
    from asyncrl.launch.demo import say_stderr

    job_dir = os.path.abspath(job_dir_for(cfg))
    resolve_model_and_data(cfg, say_stderr)
    say_stderr(f"asyncrl run: job directory {job_dir}")
    children = {"learner": start_child("learner", recipe, overrides, job_dir, list(learner_args)),
                "generator": start_child("generator", recipe, overrides, job_dir)}
    try:
        code = supervise(children, job_dir)
    except KeyboardInterrupt:
        say_stderr("\nasyncrl run: interrupted; stopping learner and generator")
        stop_all(children)
        return 130
    summary_path = os.path.join(job_dir, "summary.json")
    if code == 0 and os.path.isfile(summary_path):
        with open(summary_path) as handle:
            print_summary(json.load(handle))
        print(f"logs: {job_dir}")
    return code


def start_child(name: str, recipe, overrides: list, job_dir: str, extra_args: list = ()) -> dict:
    command = [sys.executable, "-m", "asyncrl.launch.cli", name, *extra_args,
               *(["--config", recipe] if recipe else []), *overrides, "telemetry.progress=false"]
    log_path = os.path.join(job_dir, f"{name}.log")
    env = {**os.environ, "ASYNCRL_JOB_DIR": job_dir, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # own process group: Ctrl-C reaches only us
    return {"proc": proc, "log": log_path}


def supervise(children: dict, job_dir: str) -> int:
    """Waits for the learner to finish (0) or for either child to fail (its exit code)."""
    progress_path = os.path.join(job_dir, "progress.jsonl")
    tty = sys.stderr.isatty()
    last_line, last_print = "", 0.0
    while True:
        time.sleep(0.5)
        line = latest_progress(progress_path)
        if line and line != last_line and (tty or time.monotonic() - last_print > 10):
            sys.stderr.write(("\r\033[K" + line) if tty else line + "\n")
            sys.stderr.flush()
            last_line, last_print = line, time.monotonic()
        for name, child in children.items():
            code = child["proc"].poll()
            if code is None:
                continue
            if name == "learner" and code == 0:
                if tty:
                    sys.stderr.write("\n")
                wait_or_stop(children["generator"], GRACE_S)
                return 0
            if name == "generator" and code == 0 and children["learner"]["proc"].poll() is None:
                continue  # the generator saw "done" first; the learner is finishing up
            report_failure(name, code, child["log"])
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


def report_failure(name: str, code: int, log_path: str) -> None:
    print(f"\nasyncrl run: the {name} exited with code {code}. Last lines of {log_path}:", file=sys.stderr)
    try:
        with open(log_path, errors="replace") as handle:
            tail = handle.readlines()[-TAIL_LINES:]
    except OSError:
        tail = ["(log unreadable)\n"]
    sys.stderr.write("".join("  | " + line for line in tail))


def wait_or_stop(child: dict, grace_s: float) -> None:
    try:
        child["proc"].wait(timeout=grace_s)
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
