"""Items from many requests scored together, with bounded memory and a deadline per request.

Why a batcher: a reward model's forward pass costs about the same for 1 item as for 32 on the same hardware, and
generators send one sample at a time from each reward worker; the server gathers whatever arrives within
`batch_wait_s` (up to `max_batch`) into one pass. Why bounded: a fleet can produce samples faster than one reward
model scores them; an unbounded queue would grow until the process dies. A request whose items do not all fit is
refused at once (`QueueFull`: HTTP 503 with Retry-After, which the client backs off on), and a request not scored
within `timeout_s` is answered (`ScoreTimeout`: 504) and its items are skipped if still waiting.
"""
import asyncio
import logging
import time
from collections import deque

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The request's items do not fit in the queue now: ask again later."""


class ScoreTimeout(RuntimeError):
    """The request was not scored within the server's request timeout."""


class Batcher:
    def __init__(self, score_batch, max_batch: int, batch_wait_s: float, max_queue: int, timeout_s: float):
        """`score_batch(items) -> [(score, info)]`, a coroutine, one result per item in order."""
        self.score_batch = score_batch
        self.max_batch, self.batch_wait_s, self.timeout_s = max_batch, batch_wait_s, timeout_s
        self.max_queue = max_queue
        self._waiting: deque = deque()  # (item, future); a future done before its turn (timed out) is skipped
        self._arrived = asyncio.Event()
        self.items = self.batches = self.refused = self.timeouts = self.failed_batches = 0
        self.busy_s = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def score(self, items: list) -> list:
        """Score `items` (one request's); raises QueueFull, ScoreTimeout, or what scoring raised."""
        if self.queued() + len(items) > self.max_queue:
            self.refused += 1
            raise QueueFull(f"{self.queued()} items waiting (reward_server.max_queue={self.max_queue})")
        loop = asyncio.get_running_loop()
        futures = []
        for item in items:
            future = loop.create_future()
            self._waiting.append((item, future))
            futures.append(future)
        self._arrived.set()
        try:
            return await asyncio.wait_for(asyncio.gather(*futures), self.timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            raise ScoreTimeout(f"not scored within reward_server.request_timeout_s={self.timeout_s:g} s") from None
        finally:
            for future in futures:
                future.cancel()  # still waiting: the scoring loop skips it

    def queued(self) -> int:
        """Items still waiting for their turn; those whose request gave up are dropped here, so they hold no room."""
        while self._waiting and self._waiting[0][1].done():
            self._waiting.popleft()
        if len(self._waiting) >= self.max_queue:  # dead ones further in: rebuild once, not per call
            self._waiting = deque(entry for entry in self._waiting if not entry[1].done())
        return len(self._waiting)

    def stats(self) -> dict:
        return {"items": self.items, "batches": self.batches, "mean_batch": self.items / max(self.batches, 1),
                "queued": self.queued(), "refused_full": self.refused, "timeouts": self.timeouts,
                "failed_batches": self.failed_batches, "busy_s": round(self.busy_s, 3)}

    async def _next_batch(self) -> list:
        """The live items that arrive within batch_wait_s of the first, up to max_batch."""
        while not self.queued():
            self._arrived.clear()
            await self._arrived.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.batch_wait_s
        while self.queued() < self.max_batch and loop.time() < deadline:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        batch = []
        while self._waiting and len(batch) < self.max_batch:
            item, future = self._waiting.popleft()
            if not future.done():
                batch.append((item, future))
        return batch

    async def _run(self) -> None:
        while True:
            live = await self._next_batch()
            if not live:
                continue
            started = time.monotonic()
            try:
                results = await self.score_batch([item for item, _ in live])
                if len(results) != len(live):
                    raise RuntimeError(f"scored {len(results)} of {len(live)} items")
            except Exception as err:  # one bad batch fails its requests, never the server
                self.failed_batches += 1
                log.exception("reward server: a batch of %d failed", len(live))
                for _, future in live:
                    if not future.done():
                        future.set_exception(RuntimeError(f"{type(err).__name__}: {err}"))
                continue
            finally:
                self.busy_s += time.monotonic() - started
            self.items += len(live)
            self.batches += 1
            for (_, future), result in zip(live, results):
                if not future.done():
                    future.set_result(result)
