"""The event loop of the generator and of the reward server: uvloop when it is installed, plain asyncio otherwise.

The generator's loop carries every in-flight request, the buffer client's replies, reward and tool calls; uvloop
(libuv) runs the same coroutines with less interpreter overhead per callback and per socket event.
`bench/buffer.py --compare-loops` measures the difference on the buffer clients' send path.
"""
import asyncio
import logging
import signal

log = logging.getLogger(__name__)
LOOPS = ("uvloop", "asyncio")


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
    """Run `main`; SIGTERM cancels it at its next await, its `finally` blocks run, then SystemExit(143).

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
            raise SystemExit(143) from None
        raise
    finally:
        running.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)  # the loop put back SIG_DFL: the command's own handler again
