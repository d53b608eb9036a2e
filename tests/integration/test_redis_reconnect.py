"""Riding out Redis restarts against a real redis-server: the learner's buffer and a generator's client keep going
through a kill -9 of Redis (AOF replayed, nothing lost, nothing twice), through a Redis that came back empty (state
recreated, loss said out loud), and every resendable operation is idempotent: admission, give-back, produce. A live
learner's held entries are never reclaimed from it, however long its checkpoint interval."""
import asyncio
import logging
import signal
import threading
import time
import uuid

import numpy as np
import pytest

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.buffer.interface import LearnerUnavailable
from asyncrl.buffer.redis.client import RedisBufferClient
from asyncrl.buffer.redis.conn import RedisOptions, RedisSetupError, configure_durability, connect
from asyncrl.buffer.redis.coordinator import RedisCoordinator
from asyncrl.buffer.redis.produce import produce_batch
from asyncrl.buffer.redis.reconnect import Reconnecting
from asyncrl.buffer.redis.server import RedisBufferServer
from asyncrl.buffer.redis.stream import GROUP, GroupStream
from asyncrl.weightsync.announcement import ShmRingPlace
from tests.messages import announcement, run_info
from tests.conftest import RedisServer

pytestmark = pytest.mark.redis
VOCAB = 64


def a_group(group_id: str, version: int = 0) -> Group:
    sample = Sample(completion_ids=np.array([1, 2, 3], np.int32), logprobs=np.full(3, -0.5, np.float32),
                    versions=np.full(3, version, np.int32), reward=1.0, finish_reason="stop")
    return Group(group_id=group_id, prompt_id="p", generator_id="gen", prompt_ids=np.array([4, 5], np.int32),
                 samples=[sample], sampling=Sampling(temperature=1.0), created_at=time.time())


def learner_side(url: str, job: str, patience_s: float = 30.0, reclaim_idle_s: float = 60.0):
    client = connect(RedisOptions(url))
    retry = Reconnecting(url, patience_s)
    coordinator = RedisCoordinator(client, job, lead=1 << 20, groups_per_step=1 << 20, retry=retry)
    coordinator.set_version(0, allow_backwards=True)
    server = RedisBufferServer(client, url, job, coordinator, vocab_size=VOCAB, config_hash="h",
                               max_message_bytes=1 << 20, run_info=run_info(job=job), reclaim_idle_s=reclaim_idle_s,
                               retry=retry)
    server.start()
    return server, retry


def generator_side(url: str, job: str, patience_s: float = 30.0) -> RedisBufferClient:
    return RedisBufferClient(connect(RedisOptions(url)), url, job, "gen", lead=1 << 20,
                             groups_per_step=1 << 20, lease_s=60, retry=Reconnecting(url, patience_s))


class Producer(threading.Thread):
    """A generator's request sequence (admit, then the group) for `count` groups, as fast as Redis allows."""

    def __init__(self, client: RedisBufferClient, count: int):
        super().__init__(daemon=True)
        self.client, self.count = client, count
        self.sent: list[str] = []
        self.errors: list[str] = []

    def run(self):
        async def produce():
            await self.client.hello("h")
            while len(self.sent) < self.count:
                if not (await self.client.admit(1)).granted:
                    await asyncio.sleep(0.01)
                    continue
                group_id = uuid.uuid4().hex
                reply = await self.client.send(group_id, encode_group(a_group(group_id)))
                assert reply.accepted
                self.sent.append(group_id)
                await asyncio.sleep(0.005)

        try:
            asyncio.run(produce())
        except Exception as err:
            self.errors.append(repr(err))


def drain(server: RedisBufferServer, want: int, timeout_s: float, ack_every: int = 7, on_count=None) -> list[str]:
    """Take groups as the learner does, acknowledging in batches (as checkpoints would)."""
    taken, receipts, deadline = [], [], time.monotonic() + timeout_s
    while len(taken) < want and time.monotonic() < deadline:
        group = server.take(0.5)
        if group is None:
            continue
        taken.append(group.group_id)
        if on_count is not None:
            on_count(len(taken))
        receipts += server.take_receipts()
        if len(receipts) >= ack_every:
            server.on_checkpoint(receipts)
            receipts = []
    server.on_checkpoint(receipts + server.take_receipts())
    return taken


def test_learner_and_generator_carry_on_through_a_kill_9_of_redis(tmp_path):
    """Redis is killed with -9 mid-stream and restarted 1.5 s later on the same port and AOF (everysec): both sides
    wait, reconnect and carry on; every group sent is trained exactly once."""
    redis_proc = RedisServer(str(tmp_path), appendfsync="everysec").start()
    job = "rc" + uuid.uuid4().hex[:8]
    try:
        server, retry = learner_side(redis_proc.url, job)
        producer = Producer(generator_side(redis_proc.url, job), count=80)
        producer.start()

        def crash_once(count):
            if count == 25:
                redis_proc.kill(signal.SIGKILL)
                threading.Timer(1.5, redis_proc.start).start()

        taken = drain(server, 80, timeout_s=90, on_count=crash_once)
        producer.join(timeout=60)
        assert not producer.errors, producer.errors
        assert retry.outages >= 1  # the learner really lost Redis and came back
        assert len(taken) == len(set(taken)) == 80, "a group was lost or trained twice"
        assert set(taken) == set(producer.sent)
        assert server.stream.pending_count() == 0 and server.coordinator.version == 0
    finally:
        redis_proc.kill()


def test_a_redis_that_comes_back_empty_is_rebuilt_and_the_loss_is_said(tmp_path, caplog):
    """Without AOF a restart loses the stream: the learner recreates its consumer group and the run metadata, the
    generator waits for that and carries on; the error log says queued groups were lost."""
    redis_proc = RedisServer(str(tmp_path), extra=("--appendonly", "no")).start()
    job = "em" + uuid.uuid4().hex[:8]
    try:
        server, retry = learner_side(redis_proc.url, job)
        server.announce_weights(announcement(3))
        client = generator_side(redis_proc.url, job)
        asyncio.run(client.hello("h"))
        redis_proc.kill(signal.SIGKILL)
        redis_proc.start()  # empty
        with caplog.at_level(logging.ERROR):
            assert server.take(0.5) is None  # reconnects, finds nothing, rebuilds
        assert "groups queued in it are lost" in caplog.text  # redis-py redialled silently: NOGROUP told
        reply = asyncio.run(client.admit(1))
        assert reply.granted == 1 and reply.weights.version == 3  # metadata rewritten by the learner
        asyncio.run(client.send("after", encode_group(a_group("after"))))
        assert server.take(5.0).group_id == "after"
    finally:
        redis_proc.kill()


def test_an_outage_longer_than_the_patience_is_an_error_naming_redis(tmp_path):
    redis_proc = RedisServer(str(tmp_path)).start()
    job = "pt" + uuid.uuid4().hex[:8]
    server, _ = learner_side(redis_proc.url, job, patience_s=1.0)
    client = generator_side(redis_proc.url, job, patience_s=1.0)
    redis_proc.kill(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{redis_proc.port}.*redis.reconnect_s"):
        server.take(0.5)
    with pytest.raises(LearnerUnavailable, match="127.0.0.1"):
        asyncio.run(client.admit(1))
    assert time.monotonic() - started < 10


def test_resent_admission_and_give_back_count_once(redis_server):
    job = "id" + uuid.uuid4().hex[:8]
    client = connect(RedisOptions(redis_server.url))
    coordinator = RedisCoordinator(client, job, lead=0, groups_per_step=4)
    first, _ = coordinator.try_admit("gen", want=3, request_id="gen:req1")
    again, _ = coordinator.try_admit("gen", want=3, request_id="gen:req1")  # the reply was lost: resent
    assert first == again and len(first) == 3 and coordinator.started == 3 and coordinator.leases() == 3
    assert len(coordinator.try_admit("gen", want=3)[0]) == 1 and coordinator.started == 4  # a new request: 4 - 3
    coordinator.give_back(1, token="entry-1")
    coordinator.give_back(1, token="entry-1")  # resent
    assert coordinator.started == 3
    coordinator.give_back(1)  # no token: counted every time
    assert coordinator.started == 2


def added_but_reply_lost(stream: GroupStream, group_id: str, lease: str) -> bytes:
    """A delivery whose MULTI (XADD + DELIVER) ran but whose reply never came back: nothing was settled."""
    pipe = stream.client.pipeline(transaction=True)
    stream.add(pipe, group_id, encode_group(a_group(group_id)), lease)
    return pipe.execute()[0]


def test_a_resent_delivery_is_trained_once_and_counts_once(redis_server):
    job = "dup" + uuid.uuid4().hex[:8]
    server, _ = learner_side(redis_server.url, job)
    stream, coordinator = GroupStream(server.client, job, producer="gen"), server.coordinator
    leases, _ = coordinator.try_admit("gen", want=2)
    # the reply was lost, the batch resent: the resend finds the first attempt's mark and its entry is deleted in
    # the same transaction that added it
    first = added_but_reply_lost(stream, "g1", leases[0])
    assert stream.length() == 1
    assert produce_batch(server.client, stream, [("g1", encode_group(a_group("g1")), leases[0])])[2] == [None]
    assert stream.length() == 1
    # both attempts' replies were lost, and the producer died: nobody settled anything, still one entry
    second = added_but_reply_lost(stream, "g2", leases[1])
    added_but_reply_lost(stream, "g2", leases[1])
    # a resend in a batch with a new group: only the new group's entry stays
    leases3, _ = coordinator.try_admit("gen", want=1)
    assert produce_batch(server.client, stream, [("g1", encode_group(a_group("g1")), leases[0]),
                                                 ("g3", encode_group(a_group("g3")), leases3[0])])[2][0] is None
    assert stream.length() == 3 and server.duplicates == 3
    taken = [server.take(1.0) for _ in range(3)]
    assert [group.group_id for group in taken] == ["g1", "g2", "g3"] and server.take(0.2) is None
    assert first in server.held and second in server.held
    # each lease was released once, however often its group was sent: 3 admitted, none outstanding
    assert coordinator.started == 3 and coordinator.leases() == 0
    server.on_checkpoint(server.take_receipts())
    assert stream.pending_count() == 0


def test_every_malformed_group_gives_its_admission_back_even_with_identical_bytes(redis_server):
    job = "bad" + uuid.uuid4().hex[:8]
    server, _ = learner_side(redis_server.url, job)
    stream, coordinator = GroupStream(server.client, job, producer="gen"), server.coordinator
    leases, _ = coordinator.try_admit("gen", want=2)
    produce_batch(server.client, stream, [("bad1", b"garbage", leases[0]), ("bad2", b"garbage", leases[1])])
    assert coordinator.started == 2
    assert server.take(0.5) is None
    assert server.rejected == {"malformed": 2} and len(stream.dead_letters()) == 2
    assert coordinator.started == 0  # both admissions came back: a buggy generator cannot leak capacity


def test_a_live_learners_held_entries_are_never_reclaimed(redis_server):
    """Entries awaiting a checkpoint are pending, and idle, for as long as the checkpoint interval: XAUTOCLAIM
    must not hand them back to the same learner (trained twice) nor dead-letter them for too many deliveries."""
    job = "hd" + uuid.uuid4().hex[:8]
    server, _ = learner_side(redis_server.url, job, reclaim_idle_s=0.3)
    stream = GroupStream(connect(RedisOptions(redis_server.url)), job, producer="gen")
    for index in range(3):
        stream.produce(f"g{index}", encode_group(a_group(f"g{index}")))
    first = [server.take(1.0).group_id for _ in range(3)]
    deadline = time.monotonic() + 4  # several reclaim rounds, each past the idle threshold
    while time.monotonic() < deadline:
        assert server.take(0.4) is None
        time.sleep(0.3)
    assert first == ["g0", "g1", "g2"] and server.stream.dead_letters() == []
    rows = server.client.xpending_range(server.keys["groups"], GROUP, min="-", max="+", count=10)
    assert [row["times_delivered"] for row in rows] == [1, 1, 1]


def test_a_dead_learner_incarnations_entries_are_still_reclaimed(redis_server):
    job = "dd" + uuid.uuid4().hex[:8]
    server, _ = learner_side(redis_server.url, job, reclaim_idle_s=0.2)
    old = GroupStream(connect(RedisOptions(redis_server.url)), job, consumer="learner-old", producer="gen")
    old.produce("orphan", encode_group(a_group("orphan")))
    assert [entry.entry_id for entry in old.read(10, block_ms=100)]  # delivered to a consumer that then died
    deadline = time.monotonic() + 10
    while (taken := server.take(0.3)) is None:  # reclaimed once it has been idle for reclaim_idle_s
        assert time.monotonic() < deadline, "the dead consumer's entry was never reclaimed"
    assert taken.group_id == "orphan"


def test_durability_is_configured_and_its_loss_window_stated(tmp_path, caplog):
    redis_proc = RedisServer(str(tmp_path), extra=("--appendonly", "no")).start()
    try:
        client = connect(RedisOptions(redis_proc.url))
        with caplog.at_level(logging.WARNING):
            assert "AOF off" in configure_durability(client, redis_proc.url, "")
        message = configure_durability(client, redis_proc.url, "always")
        assert "appendfsync=always" in message and "nothing: every write is on disk" in message
        assert client.config_get("appendfsync")["appendfsync"] in ("always", b"always")
        assert "machine crashes" in configure_durability(client, redis_proc.url, "everysec")
        with pytest.raises(RedisSetupError, match="appendfsync"):
            configure_durability(client, redis_proc.url, "sometimes")
    finally:
        redis_proc.kill()


def test_the_weights_message_is_read_once_per_publish(redis_server):
    """A generator reads the announcement (every tensor's name and place) only when the learner publishes a new
    one, not with every request; a new publish, even of the same version number, is read again."""
    job = "wm" + uuid.uuid4().hex[:8]
    server, _ = learner_side(redis_server.url, job)
    client = generator_side(redis_server.url, job)
    assert asyncio.run(client.hello("h")).weights is None
    server.announce_weights(announcement(2, tensors=1000))
    assert asyncio.run(client.admit(1)).weights.version == 2
    server.client.hset(server.keys["meta"], "weights", '{"version": 99}')  # the same id: not read again
    reply = asyncio.run(client.send("g1", encode_group(a_group("g1"))))
    assert reply.accepted and reply.weights.version == 2
    assert asyncio.run(client.admit(1)).weights.version == 2
    elsewhere = ShmRingPlace("/elsewhere", "host", 3)
    server.announce_weights(announcement(2, shm=elsewhere))  # a resumed learner
    reply = asyncio.run(client.send("g2", encode_group(a_group("g2"))))
    assert reply.weights.shm == elsewhere
    assert asyncio.run(client.admit(1)).weights.shm == elsewhere


def test_a_group_from_weights_newer_than_the_learner_is_dropped_and_a_negative_version_is_dead_lettered(
        redis_server):
    """The codec checks versions against the learner's; a group it refuses for that is told apart from a malformed
    one by decoding it again without the limit."""
    job = uuid.uuid4().hex[:8]
    server, _ = learner_side(redis_server.url, job)
    server.coordinator.set_version(2, allow_backwards=True)
    produce = GroupStream(server.client, job, "gen", producer="gen")
    for group_id, version in (("ahead", 3), ("negative", -1), ("fine", 2)):
        produce.produce(group_id, encode_group(a_group(group_id, version)))
    try:
        taken = server.take(5.0)
        assert taken.group_id == "fine" and server.take(0.2) is None
        assert server.dropped_future == 1 and server.rejected == {"bad_version": 1}
        dead = server.stream.dead_letters()
        assert len(dead) == 1 and dead[0][b"reason"].startswith(b"bad_version")
        assert server.stream.pending_count() == 1  # "ahead" was acked, "negative" moved out; only "fine" is held
    finally:
        server.close()
