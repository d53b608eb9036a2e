"""The learner hears the reward of every group the policy sampled, through each real buffer backend: the groups it
takes and those a generator filtered (algo.dynamic_sampling), whose rewards ride on the release. What a release
carries is hostile input: NaN, strings, huge lists and the like are counted under buffer/rejected/release_rewards
and ignored, and the buffer keeps serving."""
import asyncio
import json
import logging
import time
import uuid

import msgpack
import numpy as np
import pytest
import zmq

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.buffer.plausibility import JobLimits
from asyncrl.buffer.zmq.wire import pack
from tests.conftest import free_port
from tests.messages import run_info

N = 2
LIMITS = JobLimits(group_size=N, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, max_completion_tokens=16,
                   max_prompt_tokens=16, max_positions=64)
HOSTILE = [[float("nan"), 0.0], "0.0", [0.0] * 100_000, ["a", "b"], [0.0, 0.0, 0.0], [True, True], {"r": 1.0},
           [[0.0], [0.0]], []]
"""Release payloads no generator of the job sends (N = 2 rewards of finite numbers)."""


def varied_group(gen: str) -> Group:
    samples = [Sample(completion_ids=np.array([3, 4], np.int32), logprobs=np.array([-0.5, -1.0], np.float32),
                      versions=np.zeros(2, np.int32), reward=reward, finish_reason="stop") for reward in (1.0, 0.0)]
    return Group(group_id=uuid.uuid4().hex, prompt_id="p0", generator_id=gen, prompt_ids=np.array([1, 2], np.int32),
                 samples=samples, sampling=Sampling(1.0), created_at=time.time())


def assert_heard_two_filtered_and_one_taken(server) -> None:
    seen = server.sampled_so_far()
    assert (seen.groups, seen.varied_groups, seen.equal_values) == (3, 1, ((0.0, 1), (1.0, 1)))
    window = server.take_sampled()
    assert window["reward/sampled_mean"] == pytest.approx(3 / 6)  # (0 + 0) + (1 + 1) + (1 + 0) over 6 samples
    assert window["reward/sampled_groups"] == 3.0
    assert window["reward/sampled_frac_zero_std_groups"] == pytest.approx(2 / 3)
    assert server.take_sampled() == {}  # the next step's window starts empty
    assert server.rejected.get("release_rewards") == len(HOSTILE)


def test_zmq_release_carries_a_filtered_groups_rewards_and_hostile_ones_are_counted_and_ignored():
    from asyncrl.buffer.staleness import Coordinator
    from asyncrl.buffer.zmq.client import ZmqBufferClient
    from asyncrl.buffer.zmq.server import ZmqBufferServer

    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(1, 4), vocab_size=16, config_hash="h",
                             max_message_bytes=1 << 20, queue_groups=8, run_info=run_info(), limits=LIMITS)
    server.start()
    client = ZmqBufferClient(server.endpoint, "gen-a", timeout_s=5)
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.connect(server.endpoint)

    def raw_release(rewards, gen="gen-x"):
        raw.send_multipart([pack({"op": "release", "req": 1, "gen": gen, "count": 1, "rewards": rewards})])
        assert raw.poll(5000)
        return msgpack.unpackb(raw.recv_multipart()[-1])

    async def scenario():
        assert (await client.admit(3)).granted == 3
        await client.release(1, outcome="zero_variance", rewards=[0.0, 0.0])
        await client.release(1, outcome="zero_variance", rewards=[1, 1])
        return (await client.send("g", encode_group(varied_group("gen-a")))).accepted

    try:
        assert asyncio.run(scenario())
        assert [raw_release(rewards)["ok"] for rewards in HOSTILE] == [True] * len(HOSTILE)  # the release stands
        assert raw_release([0.0, 0.0])["released"] == 0  # valid, but it held no admission: not heard as sampled
        assert server.take(2.0) is not None
        assert_heard_two_filtered_and_one_taken(server)
        assert asyncio.run(client.admit(1)).granted == 1  # still serving
    finally:
        raw.close(linger=0)
        context.term()
        client.close()
        server.close()


@pytest.mark.redis
def test_redis_release_carries_a_filtered_groups_rewards_and_hostile_entries_are_counted_and_ignored(redis_server):
    from asyncrl.buffer.redis.client import RedisBufferClient
    from asyncrl.buffer.redis.conn import RedisOptions, connect
    from asyncrl.buffer.redis.coordinator import RedisCoordinator
    from asyncrl.buffer.redis.sampled import MAX_ENTRY_BYTES, sampled_key
    from asyncrl.buffer.redis.server import RedisBufferServer

    job, url = uuid.uuid4().hex[:8], redis_server.url
    client = connect(RedisOptions(url))
    coordinator = RedisCoordinator(client, job, lead=1, groups_per_step=4)
    coordinator.set_version(0, allow_backwards=True)
    server = RedisBufferServer(client, url, job, coordinator, vocab_size=16, config_hash="h",
                               max_message_bytes=1 << 20, run_info=run_info(job=job), limits=LIMITS)
    server.start()
    generator = RedisBufferClient(connect(RedisOptions(url)), url, job, "gen-a", lead=1, groups_per_step=4, lease_s=60)
    key = sampled_key(server.keys)

    async def scenario():
        await generator.hello("h")
        assert (await generator.admit(3)).granted == 3
        await generator.release(1, outcome="zero_variance", rewards=[0.0, 0.0])
        await generator.release(1, outcome="zero_variance", rewards=[1, 1])
        return (await generator.send("g", encode_group(varied_group("gen-a")))).accepted

    try:
        assert asyncio.run(scenario())
        # a generator writes to Redis directly: whatever it pushes is read as hostile
        entries = [json.dumps(["gen-x", rewards]) for rewards in HOSTILE[:-2]]
        entries += ["not json", "x" * (MAX_ENTRY_BYTES + 1)]
        client.rpush(key, *entries)
        assert len(entries) == len(HOSTILE)
        assert server.take(5.0) is not None
        assert_heard_two_filtered_and_one_taken(server)
        assert client.llen(key) == 0  # drained
    finally:
        generator.close()
        server.close()


@pytest.mark.redis
def test_redis_drains_every_filtered_group_of_a_step_however_many_and_keeps_the_list_bounded(redis_server):
    """A big fleet filters thousands of groups a step: one drain reads them all (DRAIN_MAX at a time), and what a
    learner that is gone leaves behind is capped at MAX_PENDING entries."""
    from asyncrl.buffer.redis.conn import RedisOptions, connect
    from asyncrl.buffer.redis.sampled import DRAIN_MAX, MAX_PENDING, drain_sampled, push_sampled, sampled_key
    from asyncrl.buffer.redis.stream import job_keys
    from asyncrl.buffer.sampled import SampledRewards
    from asyncrl.telemetry.rejections import RejectionLog

    client = connect(RedisOptions(redis_server.url))
    keys = job_keys(uuid.uuid4().hex[:8])
    try:
        count = 2 * DRAIN_MAX + 7
        client.rpush(sampled_key(keys), *[json.dumps(["gen-a", [1.0, 1.0]])] * count)
        tally = SampledRewards()
        assert drain_sampled(client, keys, tally, RejectionLog(logging.getLogger(__name__), "entry"), group_size=2) == count
        assert tally.seen().groups == count and client.llen(sampled_key(keys)) == 0
        client.rpush(sampled_key(keys), *[json.dumps(["gen-a", [0.0, 0.0]])] * MAX_PENDING)
        push_sampled(client, keys, "gen-a", [1.0, 1.0])
        assert client.llen(sampled_key(keys)) == MAX_PENDING
    finally:
        client.close()
