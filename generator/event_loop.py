"""The event loop of the generator and of the reward server: uvloop when it is installed, plain asyncio otherwise.

The generator's loop carries every in-flight request, the buffer client's replies, reward and tool calls; uvloop
(libuv) runs the same coroutines with less interpreter overhead per callback and per socket event.
`bench/buffer.py --compare-loops` measures the difference on the buffer clients' send path.
"""
import asyncio
import logging

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
    """asyncio.run(main) on the chosen loop."""
    if loop_factory(loop) is None:
        return asyncio.run(main)
    import uvloop

    return uvloop.run(main)
