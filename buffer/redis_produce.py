"""A generator's concurrent group deliveries, sent to Redis as one pipeline.

Why: a generator keeps several groups in flight (generator.max_inflight_groups) and their requests reach Redis
from worker threads. Sent one by one, each costs a network round trip (the idempotent PRODUCE script, plus the
run metadata every reply carries); on a remote Redis the round trip, not Redis, is the limit. Here the first
thread to arrive becomes the flusher and sends everything queued so far, the metadata read included, in one
pipeline; the others wait for their own result. A pipeline is not a transaction: each PRODUCE is atomic on its own
and keyed on its group id, so a failed flush is simply resent by every waiter (redis_reconnect.py).
"""
import threading
from dataclasses import dataclass, field

from asyncrl.buffer.redis_stream import GroupStream


@dataclass
class _Delivery:
    group_id: str
    payload: bytes
    lease_id: str
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple | None = None
    error: BaseException | None = None


class PipelinedProducer:
    """`produce` from any thread; returns (meta hash, version, entry id or None for a duplicate)."""

    def __init__(self, client, stream: GroupStream, max_batch: int = 64):
        self.client = client
        self.stream = stream
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Delivery] = []
        self._flushing = False
        self.flushes = 0  # pipelines sent (deliveries / flushes = the batching achieved)

    def produce(self, group_id: str, payload: bytes, lease_id: str = "") -> tuple:
        mine = _Delivery(group_id, payload, lease_id)
        with self._lock:
            self._queue.append(mine)
            lead = not self._flushing
            self._flushing = self._flushing or lead
        if lead:
            self._flush_until_empty()
        mine.done.wait()
        if mine.error is not None:
            raise mine.error
        return mine.result

    def _flush_until_empty(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                if not batch:
                    self._flushing = False
                    return
            try:
                results = self._send(batch)
            except BaseException as err:  # every waiter sees the error and resends its own delivery
                for delivery in batch:
                    delivery.error = err
                    delivery.done.set()
                continue
            for delivery, result in zip(batch, results):
                delivery.result = result
                delivery.done.set()

    def _send(self, batch: list[_Delivery]) -> list[tuple]:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.stream.keys["meta"])
        pipe.get(self.stream.keys["version"])
        for delivery in batch:
            self.stream.produce(delivery.group_id, delivery.payload, delivery.lease_id, client=pipe)
        meta, version, *entries = pipe.execute()
        self.flushes += 1
        return [(meta, int(version or 0), entry) for entry in entries]
