"""The generator's event loop: uvloop by default, plain asyncio on request or when uvloop is missing."""
import asyncio
import sys

import pytest

from asyncrl.generator.event_loop import run


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_runs_by_default_and_asyncio_on_request():
    pytest.importorskip("uvloop")
    assert run(loop_module()).startswith("uvloop")
    assert run(loop_module(), "asyncio").startswith("asyncio")


def test_without_uvloop_the_loop_is_plain_asyncio(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what `import uvloop` sees when it is not installed
    assert run(loop_module()).startswith("asyncio")


def test_an_unknown_loop_is_refused_by_the_config_and_the_runner():
    from asyncrl.configs import load_config

    with pytest.raises(ValueError, match="generator.event_loop must be uvloop or asyncio"):
        load_config(None, ["generator.event_loop=trio"])
    coroutine = loop_module()
    with pytest.raises(ValueError, match="event loop must be one of"):
        run(coroutine, "trio")
    coroutine.close()


SIGTERM_CHILD = """
import asyncio, signal, sys
from asyncrl.generator.event_loop import run
from asyncrl.launch.cli import _exit_on_sigterm

async def main():
    proc = await asyncio.create_subprocess_exec("yes", stdout=asyncio.subprocess.PIPE)  # a pipe always readable
    print("ready", flush=True)
    try:
        while await proc.stdout.read(65536):
            pass
        await asyncio.sleep(60)  # `yes` was signalled too: the pipe ended; the generator would carry on
    finally:
        try:
            proc.kill()
        except ProcessLookupError:  # `yes` died of the SIGTERM and was reaped
            pass
        await proc.wait()
        print("closed", flush=True)

signal.signal(signal.SIGTERM, _exit_on_sigterm)  # as `asyncrl generator` runs: SIGTERM is SystemExit(143)
run(main(), sys.argv[1])
"""


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_sigterm_stops_the_loop_while_a_pipe_keeps_it_busy(loop):
    """scancel (SIGTERM to every process of the job) landed in a subprocess pipe's callback under uvloop: the
    SystemExit was logged as a transport error and the generator carried on until SIGKILL (found under real SLURM,
    tests/integration/test_slurm_real.py). SIGTERM now cancels the main coroutine: its `finally` runs, exit 143."""
    import os
    import signal
    import subprocess

    if loop == "uvloop":
        pytest.importorskip("uvloop")
    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, loop], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        os.killpg(child.pid, signal.SIGTERM)  # as slurmstepd signals a job step: `yes` too, so its pipe ends
        assert child.wait(timeout=10) == 143
        assert "closed" in child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()  # by PID; its `yes` child dies of the SIGTERM above or of the closed pipe
            child.wait()


BLOCKED_CHILD = """
import asyncio, sys, time
from asyncrl.generator.event_loop import run
from asyncrl.launch.cli import _exit_on_sigterm
import signal

async def main():
    print("ready", flush=True)
    try:
        await asyncio.to_thread(time.sleep, 60)  # a weight fetch from a learner that is gone (weightsync.timeout_s)
    finally:
        print("closed", flush=True)

signal.signal(signal.SIGTERM, _exit_on_sigterm)
run(main(), sys.argv[1])
"""


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_sigterm_ends_the_process_within_seconds_while_a_thread_is_blocked(loop):
    """A generator told to stop as its learner went away took 39 s to end (issue 45): its cleanup ran at once, but
    asyncio.run and the interpreter then joined a thread still waiting for the learner's catch-up server. The
    process now ends EXIT_GRACE_S after its cleanup, with 143, and says which threads it left."""
    import signal
    import subprocess
    import time

    from asyncrl.generator.event_loop import EXIT_GRACE_S

    if loop == "uvloop":
        pytest.importorskip("uvloop")
    child = subprocess.Popen([sys.executable, "-c", BLOCKED_CHILD, loop], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # into the thread
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=EXIT_GRACE_S + 7) == 143
        assert time.monotonic() - started < EXIT_GRACE_S + 2
        assert "closed" in child.stdout.read() and "threads still blocked" in child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_commands_sigterm_handler_is_back_after_the_loop():
    import signal

    def handler(signum, frame):
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        assert run(loop_module(), "asyncio").startswith("asyncio")
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
