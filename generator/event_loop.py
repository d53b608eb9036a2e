"""The event loop of the generator and of the reward server: uvloop when it is installed, plain asyncio otherwise.

The generator's loop carries every in-flight request, the buffer client's replies, reward and tool calls; uvloop
(libuv) runs the same coroutines with less interpreter overhead per callback and per socket event.
`bench/buffer.py --compare-loops` measures the difference on the buffer clients' send path.
"""
import asyncio
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)
LOOPS = ("uvloop", "asyncio")
EXIT_GRACE_S = 3.0
"""After SIGTERM's cleanup has run (main's `finally` blocks: the learner told, the engine closed), how long the
process may still take to exit before it ends itself with 143. What can be left by then is only threads blocked in
calls awaited through `asyncio.to_thread`, which `asyncio.run` and the interpreter join before exiting: a weight
fetch from a learner that is gone waits out weightsync.timeout_s (60 s; twice, once per catch-up path), and a
generator told to stop as its learner stopped took 39 s to end (issue 45)."""


def loop_factory(name: str):
    """A new-event-loop function for `name` ("uvloop" or "asyncio"); None means asyncio's default. uvloop missing
    falls back to asyncio, with a log line."""
    if name not in LOOPS:
        raise ValueError(f"event loop must be one of {LOOPS}, got {name!r}")
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        log.info("uvloop is not installed: the event loop is plain asyncio")
        return None
    return uvloop.new_event_loop


def run(main, loop: str = "uvloop"):
    """asyncio.run(main) on the chosen loop, SIGTERM cancelling `main` (`_until_sigterm`)."""
    if loop_factory(loop) is None:
        return asyncio.run(_until_sigterm(main))
    import uvloop

    return uvloop.run(_until_sigterm(main))


async def _until_sigterm(main):
    """Run `main`; SIGTERM cancels it at its next await, its `finally` blocks run, then SystemExit(143); should
    threads blocked in calls nobody awaits any more hold the exit, the process ends EXIT_GRACE_S later (`exit_after`).

    A Python signal handler raises wherever the main thread happens to be. SLURM's scancel signals every process
    of the job at once, the reward scorer's subprocess included; its pipe's end-of-file callback then ran the
    handler, and uvloop logged the SystemExit as a transport error and went on: the cancelled generator kept
    generating until SIGKILL, KillWait seconds later. A handler on the loop runs between callbacks instead."""
    task = asyncio.current_task()
    running = asyncio.get_running_loop()
    terminated = []
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm():
        terminated.append(True)
        task.cancel()

    try:
        running.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (a test's loop): as before
        return await main
    try:
        return await main
    except asyncio.CancelledError:
        if terminated:
            exit_after(EXIT_GRACE_S, 143)
            raise SystemExit(143) from None
        raise
    finally:
        running.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)  # the loop put back SIG_DFL: the command's own handler again


def exit_after(grace_s: float, code: int) -> threading.Timer:
    """End the process with `code` in `grace_s` unless it has exited by then (a daemon timer: an exit that comes
    first takes it along). Called once the orderly cleanup is done, so what it cuts short is only the joining of
    threads still blocked in a call nobody waits for any more; the log says which, and is flushed first."""
    def end() -> None:
        blocked = [thread.name for thread in threading.enumerate()
                   if thread is not threading.current_thread() and not thread.daemon and thread.is_alive()]
        log.warning("stopping: threads still blocked %.0f s after the cleanup (%s); exiting with %d now", grace_s,
                    ", ".join(blocked) or "none", code)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream must not keep the process alive
                pass
        os._exit(code)

    timer = threading.Timer(grace_s, end)
    timer.daemon = True
    timer.start()
    return timer
