"""The Redis stream buffer and coordinator against a real redis-server: idempotent produce, consumer-group reads,
redelivery after a restart, XAUTOCLAIM from a dead consumer, dead letters, safe trimming, blocking reads longer
than redis-py's default timeout, connection checks, leases, and AOF durability across a kill -9 of Redis."""
import signal
import threading
import time
import uuid

import pytest
import redis

from asyncrl.buffer.redis.conn import RedisOptions, RedisSetupError, check_server, connect, redacted
from asyncrl.buffer.redis.coordinator import RedisCoordinator
from asyncrl.buffer.redis.produce import produce_batch
from asyncrl.buffer.redis.stream import GroupStream
from asyncrl.buffer.staleness import admission_capacity
from tests.conftest import RedisServer, free_port

pytestmark = pytest.mark.redis


@pytest.fixture
def client(redis_server):
    client = connect(RedisOptions(redis_server.url, block_ms=6000))
    yield client
    client.close()


@pytest.fixture
def job():
    return uuid.uuid4().hex[:8]


def stream_for(client, job, consumer="learner-0", **kwargs):
    stream = GroupStream(client, job, consumer, **kwargs)
    stream.ensure_group()
    return stream


def test_server_check_passes_and_names_what_is_wrong(client, redis_server):
    assert check_server(client, redis_server.url)["redis_version"] >= "6.2"
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(RedisSetupError, match="maxmemory-policy 'allkeys-lru'.*noeviction"):
            check_server(client, redis_server.url)
    finally:
        client.config_set("maxmemory-policy", "noeviction")
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisSetupError, match="cannot reach Redis at redis://127.0.0.1"):
        check_server(connect(RedisOptions(dead)), dead)
    with pytest.raises(RedisSetupError, match="must start with redis://"):
        connect(RedisOptions("http://127.0.0.1:1"))


def test_acl_user_and_password_in_the_url(client, redis_server):
    user = f"gen{uuid.uuid4().hex[:6]}"
    client.acl_setuser(user, enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])
    try:
        good = f"redis://{user}:s3cret@127.0.0.1:{redis_server.port}/0"
        check_server(connect(RedisOptions(good)), good)
        bad = f"redis://{user}:wrong@127.0.0.1:{redis_server.port}/0"
        with pytest.raises(RedisSetupError, match="refused the credentials") as error:
            check_server(connect(RedisOptions(bad)), bad)
        assert "wrong" not in str(error.value) and redacted(bad).endswith(f"{user}:***@127.0.0.1:{redis_server.port}/0")
    finally:
        client.acl_deluser(user)


def test_produce_is_idempotent_on_group_id(client, job):
    stream = stream_for(client, job)
    first = stream.produce("g1", b"payload")
    assert first is not None
    assert stream.produce("g1", b"payload") is None  # a resend after a lost reply adds nothing
    stream.produce("g2", b"other")
    assert stream.length() == 2


def test_a_batch_of_deliveries_is_one_round_trip(client, job):
    """DELIVER goes as EVAL: a registered script on a pipeline would make redis-py ask SCRIPT EXISTS before every
    batch, one more round trip each, which on a remote Redis costs more than the batch itself."""
    stream = stream_for(client, job)
    client.config_resetstat()
    for batch in range(3):
        produce_batch(client, stream, [(f"g{batch}-{i}", b"payload", "") for i in range(4)])
    stats = client.info("commandstats")
    assert not [name for name in stats if "script" in name], stats
    assert stats["cmdstat_exec"]["calls"] == 3 and stats["cmdstat_eval"]["calls"] == 12
    assert stream.length() == 12


def test_unacked_entries_come_back_to_a_restarted_consumer_first(client, job):
    stream = stream_for(client, job)
    for index in range(5):
        stream.produce(f"g{index}", f"p{index}".encode())
    got = stream.read(3, block_ms=100)
    stream.ack([got[0][0]])  # trained and covered by a checkpoint
    restarted = stream_for(client, job)  # same consumer name after a kill -9
    again = restarted.read(10, block_ms=100)
    assert [entry.payload for entry in again] == [b"p1", b"p2"]  # pending first, the acked one never again
    fresh = restarted.read(10, block_ms=100)
    assert [entry.payload for entry in fresh] == [b"p3", b"p4"]
    assert restarted.read(10, block_ms=50) == []


def test_dead_consumers_entries_are_reclaimed_and_poison_goes_to_dead_letters(client, job):
    dead = stream_for(client, job, consumer="learner-old", max_deliveries=2)
    for index in range(3):
        dead.produce(f"g{index}", f"p{index}".encode())
    assert len(dead.read(3, block_ms=100)) == 3  # then it dies holding them
    alive = stream_for(client, job, consumer="learner-new", max_deliveries=2)
    claimed = alive.reclaim(min_idle_ms=0)
    assert [entry.payload for entry in claimed] == [b"p0", b"p1", b"p2"]
    alive.dead_letter(claimed[0].entry_id, claimed[0].payload, "codec: not msgpack")
    assert alive.reclaim(min_idle_ms=0) == []  # a 3rd delivery (> max_deliveries=2): dead letters instead
    letters = alive.dead_letters()
    assert letters[0][b"reason"] == b"codec: not msgpack" and letters[0][b"payload"] == b"p0"
    assert {letter[b"payload"] for letter in letters[1:]} == {b"p1", b"p2"}
    assert all(b"delivered 3 times" in letter[b"reason"] for letter in letters[1:])
    assert alive.pending_count() == 0


def test_trimming_never_deletes_unconsumed_entries(client, job):
    stream = stream_for(client, job)
    ids = [stream.produce(f"g{index}", b"x") for index in range(10)]
    got = stream.read(10, block_ms=100)
    stream.ack([entry.entry_id for entry in got[:6]])
    assert stream.trim() == 6 and stream.length() == 4  # the 4 pending stay
    for index in range(10, 13):
        stream.produce(f"g{index}", b"x")  # never read yet
    stream.ack([entry.entry_id for entry in got[6:]])
    stream.trim()
    remaining = [entry_id for entry_id, _ in client.xrange(stream.keys["groups"])]
    assert ids[-1] in remaining and len(remaining) == 4  # the last delivered one plus the 3 unread
    assert [entry.payload for entry in stream.read(10, block_ms=100)] == [b"x"] * 3


def test_a_blocking_read_longer_than_redis_py_default_timeout_waits_quietly(client, job):
    stream = stream_for(client, job)
    started = time.monotonic()
    assert stream.read(1, block_ms=5500) == []  # redis-py 8's socket_timeout=5 would raise TimeoutError here
    assert time.monotonic() - started >= 5.4


def test_admission_follows_the_design_rule_and_leases_expire(client, job):
    coordinator = RedisCoordinator(client, job, lead=1, groups_per_step=4, lease_s=10)
    stream = stream_for(client, job)
    leases, version = coordinator.try_admit("gen-a", want=100, now_ms=1_000)
    assert version == 0 and len(leases) == admission_capacity(1, 0, 4, 0) == 8
    assert coordinator.try_admit("gen-b", want=1, now_ms=1_000)[0] == []  # full
    stream.produce("g0", b"x", lease_id=leases[0])  # delivered: its lease is released, still counted as started
    assert coordinator.leases() == 7 and coordinator.started == 8
    # gen-a is killed -9 holding 7 leases: after the lease time they come back
    granted, _ = coordinator.try_admit("gen-b", want=100, now_ms=1_000 + 10_001)
    assert len(granted) == 7 and coordinator.started == 8
    stream.produce("g1", b"x", lease_id=leases[1])  # gen-a was only slow: its late group counts again
    assert coordinator.started == 9
    coordinator.set_version(1)
    assert len(coordinator.try_admit("gen-b", want=100, now_ms=20_000)[0]) == admission_capacity(1, 1, 4, 9) == 3
    assert coordinator.set_version(0) == 1 and coordinator.set_version(0, allow_backwards=True) == 0


def test_concurrent_admission_never_exceeds_capacity(redis_server, job):
    coordinator_clients = [connect(RedisOptions(redis_server.url)) for _ in range(4)]
    granted = []

    def admit(client):
        coordinator = RedisCoordinator(client, job, lead=2, groups_per_step=5)
        for _ in range(20):
            granted.extend(coordinator.try_admit(f"gen-{id(client)}", want=1)[0])

    threads = [threading.Thread(target=admit, args=(c,)) for c in coordinator_clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(granted) == len(set(granted)) == admission_capacity(2, 0, 5, 0) == 15


def test_groups_survive_a_kill_9_of_redis_with_appendfsync_always(tmp_path, job):
    server = RedisServer(str(tmp_path), appendfsync="always").start()
    try:
        client = connect(RedisOptions(server.url))
        stream = stream_for(client, job)
        for index in range(20):
            stream.produce(f"g{index}", f"p{index}".encode())
        assert len(stream.read(5, block_ms=100)) == 5
        server.kill(signal.SIGKILL)
        with pytest.raises(redis.ConnectionError):
            stream.length()
        server.start()  # same port, same directory: the AOF is replayed
        assert stream.length() == 20 and stream.pending_count() == 5  # every produce and the delivery state
        assert stream.produce("g3", b"again") is None  # idempotence marks survive too
        payloads = [entry.payload for entry in stream_for(client, job).read(100, block_ms=100)]
        assert payloads[:5] == [b"p0", b"p1", b"p2", b"p3", b"p4"]
    finally:
        server.kill()


def test_a_generator_releases_the_leases_of_groups_it_filtered_and_no_more(client, job, redis_server):
    """algo.dynamic_sampling on the Redis backend: a generator's `release` gives its leases back at once (the
    capacity returns without waiting for the lease to expire), and never more than it holds."""
    import asyncio

    from asyncrl.buffer.redis.client import RedisBufferClient

    coordinator = RedisCoordinator(client, job, lead=0, groups_per_step=3)
    coordinator.set_version(0)
    client.hset(coordinator.keys["meta"], "config_hash", "h")  # what a registered learner writes
    generator = RedisBufferClient(connect(RedisOptions(redis_server.url)), redis_server.url, job, "gen-a",
                                  lead=0, groups_per_step=3, lease_s=60)

    async def scenario():
        granted = (await generator.admit(10)).granted
        await generator.release(2)
        after_release = (coordinator.started, coordinator.leases())
        return granted, after_release, (await generator.admit(10)).granted

    try:
        assert asyncio.run(scenario()) == (3, (1, 1), 2)
        asyncio.run(generator.release(100))
        assert coordinator.started == 0 and coordinator.leases() == 0 and generator.leases == []
    finally:
        generator.close()
