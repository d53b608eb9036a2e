"""Riding out a Redis restart: retry an operation through connection loss, for a bounded time.

Why per operation rather than redis-py's own `Retry`: a retry is only safe when re-running the operation cannot
change the outcome, and that is a property of what asyncrl does, not of the command. Every operation passed here is
idempotent by construction (produce is keyed on the group id, admission on its lease prefix, give-back on a token,
acks and hash writes are naturally so); a reply lost in the crash is then harmless to resend. A read whose reply was
lost leaves entries pending but unseen: listeners registered with `on_reconnect` re-read the pending list (see
RedisBufferServer), which is how nothing delivered during the outage is lost.

redis-py drops a broken connection from its pool and dials a fresh one on the next command, so retrying is enough
to reconnect. `BusyLoadingError` (a restarted server still loading its AOF) is a ConnectionError there, so it is
waited out the same way.
"""
import logging
import time

import redis

from asyncrl.buffer.redis.conn import redacted

log = logging.getLogger(__name__)
RETRYABLE = (redis.ConnectionError, redis.TimeoutError)


class RedisUnavailable(RuntimeError):
    """Redis did not come back within buffer.redis.reconnect_s; the message names the server and the wait."""


class Reconnecting:
    """Runs idempotent Redis operations, retrying with backoff while the server is unreachable.

    `patience_s` bounds the whole outage one operation may wait through (buffer.redis.reconnect_s); past it the
    caller gets RedisUnavailable. After a failure, listeners run before each retry (they restore what the server may
    have lost, such as the consumer group the retried read needs); they must be idempotent and must not themselves
    go through this object.
    """

    def __init__(self, url: str, patience_s: float, sleep=time.sleep, clock=time.monotonic):
        self.endpoint = redacted(url)
        self.patience_s = patience_s
        self.sleep, self.clock = sleep, clock
        self.listeners: list = []
        self.outages = 0
        """How many times the connection was lost and came back (a counter for metrics and tests)."""

    def on_reconnect(self, callback) -> None:
        self.listeners.append(callback)

    def within(self, patience_s: float) -> "Reconnecting":
        """The same policy with a shorter patience, for a request that has its own deadline (a generator's last
        `bye` must not hold its exit for the whole outage allowance)."""
        bounded = Reconnecting(self.endpoint, min(patience_s, self.patience_s), self.sleep, self.clock)
        bounded.listeners = self.listeners
        return bounded

    def __call__(self, what: str, operation, *args, **kwargs):
        lost_at, delay = None, 0.05
        while True:
            try:
                if lost_at is not None:  # the server may be back: restore what it lost before retrying
                    for callback in self.listeners:
                        callback()
                result = operation(*args, **kwargs)
            except RETRYABLE as err:
                now = self.clock()
                if lost_at is None:
                    lost_at = now
                    log.warning("Redis at %s: %s failed (%s); reconnecting for up to %.0f s", self.endpoint, what,
                                err, self.patience_s)
                if now - lost_at >= self.patience_s:
                    raise RedisUnavailable(
                        f"Redis at {self.endpoint} has not answered {what} for {now - lost_at:.0f} s (last error: "
                        f"{err}); buffer.redis.reconnect_s={self.patience_s:g} bounds the wait. Is redis-server "
                        f"running and reachable?") from None
                self.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if lost_at is not None:
                self.outages += 1
                log.warning("Redis at %s answered again after %.1f s", self.endpoint, self.clock() - lost_at)
            return result


class NoRetry:
    """Runs each operation once (the `Reconnecting` interface without the retrying): for tools and tests that want
    the first error, and for calls made from inside a retry (a reconnect listener)."""

    outages = 0
    """Never reconnects, so never counts an outage."""

    def __call__(self, what: str, operation, *args, **kwargs):
        return operation(*args, **kwargs)

    def on_reconnect(self, callback) -> None:
        """Nothing reconnects here, so a listener would never run."""

    def within(self, patience_s: float) -> "NoRetry":
        return self


direct = NoRetry()
"""The policy of a caller that wants no retrying."""
