"""The delivery batcher's logic with a fake send: concurrent deliveries share batches (one worker-thread hop and
one pipeline each), each gets its own result, and a failed batch fails exactly the deliveries in it."""
import asyncio
import time

import pytest

from asyncrl.buffer.redis.produce import DeliveryBatcher


class FakeSend:
    """Stands in for produce_batch: one round trip per call, during which more deliveries queue up."""

    def __init__(self):
        self.batches: list[list] = []
        self.fail_next = False

    def __call__(self, items):
        time.sleep(0.02)
        self.batches.append(list(items))
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("connection lost mid-pipeline")
        return {b"config_hash": b"h"}, 7, [None if item == "dup" else f"id-{item}".encode() for item in items]


async def deliver_all(batcher, items):
    return await asyncio.gather(*(batcher.deliver(item) for item in items), return_exceptions=True)


def test_concurrent_deliveries_share_batches_and_get_their_own_results():
    send = FakeSend()
    batcher = DeliveryBatcher(send, max_batch=8)
    items = [f"g{i}" for i in range(20)] + ["dup"]
    results = asyncio.run(deliver_all(batcher, items))
    assert [len(batch) for batch in send.batches] == [8, 8, 5] and batcher.batches == 3
    assert results[3] == ({b"config_hash": b"h"}, 7, b"id-g3") and results[-1][2] is None


def test_a_failed_batch_fails_only_its_deliveries_and_the_next_goes_through():
    send = FakeSend()
    send.fail_next = True
    batcher = DeliveryBatcher(send, max_batch=4)
    results = asyncio.run(deliver_all(batcher, [f"g{i}" for i in range(6)]))
    assert all(isinstance(r, ConnectionError) for r in results[:4]) and results[4][2] == b"id-g4"
    with pytest.raises(ConnectionError):
        send.fail_next = True
        asyncio.run(batcher.deliver("alone"))
    assert asyncio.run(batcher.deliver("alone"))[2] == b"id-alone"  # the resend goes through
