"""The pipelined producer's batching logic with a fake stream and client: concurrent deliveries share pipelines,
each gets its own result, and a failed pipeline fails exactly the deliveries in it (each then resends its own)."""
import threading
import time

import pytest

from asyncrl.buffer.redis_produce import PipelinedProducer


class FakePipe:
    def __init__(self, owner):
        self.owner, self.queued = owner, []

    def hgetall(self, key):
        self.queued.append({b"config_hash": b"h"})
        return self

    def get(self, key):
        self.queued.append(b"7")
        return self

    def execute(self):
        time.sleep(0.02)  # a round trip, during which other deliveries queue up
        self.owner.pipelines.append(len(self.queued) - 2)
        if self.owner.fail_next:
            self.owner.fail_next = False
            raise ConnectionError("connection lost mid-pipeline")
        return self.queued


class FakeStream:
    keys = {"meta": "m", "version": "v"}

    def produce(self, group_id, payload, lease_id="", client=None):
        client.queued.append(None if group_id == "dup" else f"id-{group_id}".encode())


class FakeClient:
    def __init__(self):
        self.pipelines: list[int] = []
        self.fail_next = False

    def pipeline(self, transaction):
        assert transaction is False  # each PRODUCE is atomic alone; the batch needs no MULTI
        return FakePipe(self)


def deliver_concurrently(producer, names):
    results, errors = {}, {}

    def one(name):
        try:
            results[name] = producer.produce(name, b"payload")
        except ConnectionError as err:
            errors[name] = err

    threads = [threading.Thread(target=one, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def test_concurrent_deliveries_share_pipelines_and_get_their_own_results():
    client = FakeClient()
    producer = PipelinedProducer(client, FakeStream())
    names = [f"g{i}" for i in range(16)] + ["dup"]
    results, errors = deliver_concurrently(producer, names)
    assert not errors and sum(client.pipelines) == 17 and len(client.pipelines) < 17  # batched
    assert producer.flushes == len(client.pipelines)
    assert results["g3"] == ({b"config_hash": b"h"}, 7, b"id-g3") and results["dup"][2] is None


def test_a_failed_pipeline_fails_only_its_deliveries():
    client = FakeClient()
    client.fail_next = True
    producer = PipelinedProducer(client, FakeStream())
    results, errors = deliver_concurrently(producer, [f"g{i}" for i in range(8)])
    assert len(errors) == client.pipelines[0] and len(results) == 8 - len(errors)
    with pytest.raises(ConnectionError):
        client.fail_next = True
        producer.produce("alone", b"x")
    assert producer.produce("alone", b"x")[2] == b"id-alone"  # the resend goes through
