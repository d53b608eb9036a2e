"""A generator's concurrent group deliveries, sent to Redis as one pipeline.

Why: a generator keeps several groups in flight (generator.max_inflight_groups). Sent one by one, each delivery
costs a network round trip (its XADD and DELIVER, plus the run metadata every reply carries) and a hop to a worker
thread; on a remote Redis the round trip, not Redis, is the limit. Here deliveries made while a batch is out wait
for the next one, which carries all of them and one metadata read in one MULTI, one round trip and one
worker-thread hop. A failed batch is simply sent again (reconnect.py): each group's first attempt is the one
that counts (stream.py's protocol), and a later one only deletes its own entry.
"""
import asyncio

from asyncrl.buffer.redis.stream import GroupStream


def produce_batch(client, stream: GroupStream, deliveries: list, fields: tuple = ("done",)) -> tuple:
    """deliveries: (group_id, payload, lease_id, deal id). Returns (the run metadata's `fields`, as HMGET returns
    them; version; [entry id, None for a group delivered before, or stream.REFUSED, per delivery])."""
    pipe = client.pipeline(transaction=True)
    pipe.hmget(stream.keys["meta"], *fields)
    pipe.get(stream.keys["version"])
    for group_id, payload, lease_id, *deal in deliveries:
        stream.add(pipe, group_id, payload, lease_id, *deal)
    meta, version, *replies = pipe.execute()
    return meta, int(version or 0), stream.settle(replies)


class DeliveryBatcher:
    """`await deliver(item)` from any number of tasks; `send(items) -> (meta, version, results)` runs in a worker
    thread, one call per batch (the caller wraps it in its retry policy)."""

    def __init__(self, send, max_batch: int = 64):
        self.send = send
        self.max_batch = max_batch
        self._waiting: list = []  # (item, future)
        self._flusher: asyncio.Task | None = None
        self.batches = 0  # pipelines sent (deliveries / batches = the batching achieved)

    async def deliver(self, item) -> tuple:
        """(meta, version, this item's result)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:self.max_batch], self._waiting[self.max_batch:]
            try:
                meta, version, results = await asyncio.to_thread(self.send, [item for item, _ in batch])
            except BaseException as err:  # every delivery in the batch fails with it (each caller decides)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(err)
                if isinstance(err, asyncio.CancelledError):
                    raise
                continue
            self.batches += 1
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result((meta, version, result))
