"""Counting and logging rejected input without letting a flood of it flood the log.

A broken or hostile generator can send thousands of bad groups a second; one WARNING each would bury everything
else (and cost more than rejecting them). `RejectionLog` counts every rejection by reason (the counts become
`buffer/rejected/<reason>`) and logs the first of each reason at once, then at most one line per reason every
`every_s` seconds saying how many more there were and the last one's error. Thread-safe: the zmq server's two
threads both reject. The generator counts its failed reward calls with it too (`area`, `verb`), which is why it
lives in telemetry/ (standard library only, so the buffer may import it) rather than in buffer/.
"""
import logging
import threading
import time
from collections import Counter


class RejectionLog:
    def __init__(self, logger: logging.Logger, what: str, every_s: float = 10.0, clock=time.monotonic,
                 area: str = "buffer", verb: str = "rejected"):
        self.logger, self.what, self.every_s, self.clock = logger, what, every_s, clock
        self.area, self.verb = area, verb
        self.counts: Counter = Counter()
        self._unlogged: Counter = Counter()  # reason -> rejections since its last log line
        self._last_logged: dict = {}  # reason -> when its last line was written
        self._lock = threading.Lock()

    def reject(self, reason: str, source: str, error: str) -> None:
        """Count one rejection, and log it unless this reason was logged less than `every_s` ago."""
        with self._lock:
            self.counts[reason] += 1
            self._unlogged[reason] += 1
            now = self.clock()
            last = self._last_logged.get(reason)
            if last is not None and now - last < self.every_s:
                return
            count, self._unlogged[reason] = self._unlogged[reason], 0
            self._last_logged[reason] = now
        if count == 1:
            self.logger.warning("%s: %s %s from %s (%s): %s", self.area, self.verb, self.what, source, reason, error)
        else:
            self.logger.warning("%s: %s %s %d times (%s) in the last %.0f s; the last from %s: %s", self.area,
                                self.verb, self.what, count, reason, now - last, source, error)

    def snapshot(self) -> dict:
        """reason -> rejections so far (a copy)."""
        with self._lock:
            return dict(self.counts)
