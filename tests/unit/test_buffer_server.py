"""The embedded ZeroMQ buffer over real sockets: bad input is rejected and counted, the server keeps serving."""
import asyncio
import time

import msgpack
import numpy as np
import pytest
import zmq

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.buffer.zmq.wire import pack
from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.interface import GeneratorRefused, LearnerUnavailable
from asyncrl.buffer.zmq.client import ZmqBufferClient
from asyncrl.buffer.zmq.server import ZmqBufferServer
from asyncrl.weightsync.announcement import AnnouncementError, ShmRingPlace
from tests.messages import announcement, run_info
from tests.conftest import free_port


def group(reward=1.0, token=3, version=0, gen="gen-a"):
    """A valid one-sample group from generator `gen` (a group must carry its connection's generator id)."""
    sample = Sample(completion_ids=np.array([token, 4], np.int32), logprobs=np.array([-0.5, -1.0], np.float32),
                    versions=np.array([version, version], np.int32), reward=reward, finish_reason="stop")
    return Group(group_id="abc", prompt_id="p0", generator_id=gen, prompt_ids=np.array([1, 2], np.int32),
                 samples=[sample], sampling=Sampling(1.0), created_at=time.time())


@pytest.fixture
def server():
    srv = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(1, 2), vocab_size=16, config_hash="h",
                          max_message_bytes=4096, queue_groups=2, run_info=run_info(job="k"))
    srv.start()
    yield srv
    srv.close()


def run(coroutine):
    return asyncio.run(coroutine)


def test_bad_groups_are_rejected_counted_given_back_and_their_generator_is_told():
    """Groups are validated when the learner takes them: bad ones are skipped, counted by reason, their admissions
    freed, and the generator hears of them in its next reply. Only an oversized group is refused at once."""
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(1, 2), vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=8, run_info=run_info())
    server.start()
    client = ZmqBufferClient(server.endpoint, "gen-a", timeout_s=5)
    wrong_schema = msgpack.unpackb(encode_group(group()), raw=False)
    wrong_schema["schema"] = 99

    async def scenario():
        granted = (await client.admit(4)).granted
        replies = []
        for index, payload in enumerate((b"\x00garbage\xff", msgpack.packb(wrong_schema, use_bin_type=True),
                                         encode_group(group(reward=float("nan"))), encode_group(group(token=999)),
                                         b"\x00" * 5000, encode_group(group()))):
            replies.append(await client.send(f"g{index}", payload))
        taken = await asyncio.to_thread(server.take, 1.0)
        return granted, replies, taken, await client.report({}), await client.report({})

    try:
        granted, replies, taken, told, after = asyncio.run(scenario())
    finally:
        client.close()
        server.close()
    assert granted == 4
    assert [r.accepted for r in replies] == [True] * 4 + [False, True]
    assert replies[4].reason == "too_large" and "max_message_bytes=4096" in replies[4].error
    assert not replies[4].retry
    assert taken.group_id == "abc"
    assert server.rejected == {"malformed": 1, "schema": 1, "bad_reward": 1, "token_out_of_range": 1,
                               "too_large": 1}
    assert {key: value for key, value in server.metrics().items() if key.startswith("buffer/rejected/")} == {
        "buffer/rejected/malformed": 1.0, "buffer/rejected/schema": 1.0, "buffer/rejected/bad_reward": 1.0,
        "buffer/rejected/token_out_of_range": 1.0, "buffer/rejected/too_large": 1.0}
    assert told.rejected.count == 4 and "token_out_of_range" in told.rejected.last_error
    assert after.rejected is None  # told once
    # the four admitted bad groups gave their capacity back; the oversized and the valid one held none to give
    assert server.coordinator.started == 0 and server.received == 1


def test_malformed_control_frames_do_not_stop_the_server(server):
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.connect(server.endpoint)
    raw.send_multipart([b"not msgpack"])
    raw.send_multipart([pack({"op": "explode", "req": 1, "gen": "x"})])
    for _ in range(2):
        assert raw.poll(5000) and msgpack.unpackb(raw.recv_multipart()[-1])["ok"] is False
    raw.close(linger=0)
    context.term()
    client = ZmqBufferClient(server.endpoint, "gen-b", timeout_s=5)
    assert run(client.hello("h")).run_info == run_info(job="k")
    client.close()
    assert server.rejected["malformed"] == 2


def test_config_mismatch_is_refused_with_a_clear_message(server):
    client = ZmqBufferClient(server.endpoint, "gen-c", timeout_s=5)
    with pytest.raises(GeneratorRefused, match="config mismatch.*gen-c"):
        run(client.hello("other"))
    client.close()


def test_admission_is_paced_and_a_full_queue_asks_to_retry(server):
    client = ZmqBufferClient(server.endpoint, "gen-d", timeout_s=5)

    async def scenario():
        first = await client.admit(10)
        second = await client.admit(1)
        sent = [await client.send(str(index), encode_group(group(gen="gen-d"))) for index in range(3)]
        return first, second, sent

    first, second, replies = asyncio.run(scenario())
    client.close()
    assert first.granted == 4  # (η + v + 1) * B = (1 + 0 + 1) * 2
    assert second.granted == 0
    assert [r.accepted for r in replies] == [True, True, False] and replies[2].retry


def test_a_dead_learner_is_named_in_the_error():
    port = free_port()
    client = ZmqBufferClient(f"tcp://127.0.0.1:{port}", "gen-e", timeout_s=0.3)
    with pytest.raises(LearnerUnavailable, match=str(port)):
        run(client.admit(1))
    client.close()


def test_a_learner_that_dies_with_requests_waiting_fails_them_at_once_and_the_next_is_answered():
    """A learner killed while a generator's requests wait on it: its end of the connection closes, and the requests
    fail at once naming it, not after their 30 s timeout (the soak's generators sat out 30 s per learner kill). The
    resumed learner, on the same port, answers the next request: libzmq reconnected by itself."""
    port = free_port()
    context = zmq.Context()
    mute = context.socket(zmq.ROUTER)  # a learner that takes requests and never answers, then dies
    mute.bind(f"tcp://127.0.0.1:{port}")
    client = ZmqBufferClient(f"tcp://127.0.0.1:{port}", "gen-k", timeout_s=30)

    async def waiting():
        asyncio.get_running_loop().call_later(0.5, lambda: mute.close(linger=0))
        return await asyncio.gather(client.admit(1), client.report({"x": 1.0}), return_exceptions=True)

    started = time.monotonic()
    errors = run(waiting())
    assert time.monotonic() - started < 5
    assert all(isinstance(err, LearnerUnavailable) and "closed the connection" in str(err) and str(port) in str(err)
               for err in errors), errors
    context.term()
    resumed = ZmqBufferServer("127.0.0.1", port, Coordinator(1, 2), vocab_size=16, config_hash="h",
                              max_message_bytes=4096, queue_groups=2, run_info=run_info())
    resumed.start()
    try:
        assert run(client.admit(1)).granted == 1
    finally:
        client.close()
        resumed.close()


def test_finished_learner_keeps_serving_until_every_recent_generator_heard_done(server):
    client = ZmqBufferClient(server.endpoint, "late", timeout_s=5)

    async def scenario():
        await client.admit(1)
        started = time.monotonic()
        unheard = await asyncio.to_thread(server.finish, 0.3)  # it has not polled since
        waited = time.monotonic() - started
        reply = await client.admit(1)
        started = time.monotonic()
        unheard_after = await asyncio.to_thread(server.finish, 5.0)
        return unheard, waited, reply, unheard_after, time.monotonic() - started

    unheard, waited, reply, unheard_after, waited_after = asyncio.run(scenario())
    client.close()
    assert unheard == ["late"] and waited >= 0.3
    assert reply.done and reply.granted == 0
    assert unheard_after == [] and waited_after < 1.0  # everyone has heard: returns at once


def test_the_weights_message_goes_to_each_generator_once_per_publish(server):
    """The announcement lists every tensor, so a reply carries it only to a generator that lacks it; the client
    keeps it and hands it to every caller, and a new publish (even of the same version number) is sent again."""
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.connect(server.endpoint)

    def raw_reply(wid):
        fields = {"op": "admit", "req": 1, "gen": "raw"} | ({} if wid is None else {"wid": wid})
        raw.send_multipart([pack(fields)])
        assert raw.poll(5000)
        return msgpack.unpackb(raw.recv_multipart()[-1])

    client = ZmqBufferClient(server.endpoint, "gen-w", timeout_s=5)
    try:
        assert run(client.admit(1)).weights is None  # nothing published yet
        server.announce_weights(announcement(1, tensors=1000))
        first = raw_reply("")
        assert first["weights"]["version"] == 1 and first["weights_id"]
        assert "weights" not in raw_reply(first["weights_id"])  # holds it: only the id comes back
        assert raw_reply(None)["weights"]["version"] == 1  # a client that sends no `wid` always gets it
        assert [run(client.admit(1)).weights.version for _ in range(3)] == [1, 1, 1]
        assert client.weights_id == first["weights_id"]
        server.announce_weights(announcement(1, shm=ShmRingPlace("/elsewhere", "host", 3)))  # a resumed learner
        assert run(client.admit(1)).weights.shm == ShmRingPlace("/elsewhere", "host", 3)
        assert client.weights_id != first["weights_id"]
    finally:
        client.close()
        raw.close(linger=0)
        context.term()


def test_groups_sent_together_travel_in_one_message_and_each_caller_gets_its_own_result():
    """The client puts consecutive group requests in one message with `reqs`; the reply's `results` are handed out
    one per caller, each with the reply's common fields."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    client = ZmqBufferClient(f"tcp://127.0.0.1:{port}", "gen-batch", timeout_s=5)

    def serve_one():
        assert router.poll(5000)
        identity, header, *bodies = router.recv_multipart()
        request = msgpack.unpackb(header)
        results = [{"req": req, "accepted": index != 1, "retry": index == 1}
                   for index, req in enumerate(request["reqs"])]
        router.send_multipart([identity, pack({"req": request["req"], "ok": True, "version": 7, "weights_id": "w7",
                                               "weights": announcement(7).to_wire(), "done": False,
                                               "results": results})])
        return request, bodies

    async def scenario():
        server = asyncio.create_task(asyncio.to_thread(serve_one))
        replies = await asyncio.gather(*(client.send(str(i), bytes([i]) * (i + 1)) for i in range(3)))
        return replies, await server

    try:
        replies, (request, bodies) = asyncio.run(scenario())
    finally:
        client.close()
        router.close(linger=0)
        context.term()
    assert request["op"] == "group" and len(request["reqs"]) == 3 and bodies == [b"\x00", b"\x01\x01", b"\x02" * 3]
    assert [r.accepted for r in replies] == [True, False, True] and replies[1].retry
    assert all(r.weights == announcement(7) for r in replies)  # the reply's common fields, in every result


def test_the_server_answers_each_group_of_a_batch_and_refuses_a_batch_it_cannot_match():
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(1, 2), vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=2, run_info=run_info())
    server.start()
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.connect(server.endpoint)

    def send(header, bodies):
        raw.send_multipart([pack({"op": "group", "req": 1, "gen": "raw"} | header), *bodies])
        assert raw.poll(5000)
        return msgpack.unpackb(raw.recv_multipart()[-1])

    try:
        good = encode_group(group(gen="raw"))
        reply = send({"reqs": [1, 2, 3, 4]}, [good, b"\x00" * 5000, good, good])
        mismatched = send({"reqs": [5, 6]}, [good])
        taken = [server.take(1.0) for _ in range(2)]
    finally:
        raw.close(linger=0)
        server.close()
        context.term()
    assert [(r["req"], r["accepted"]) for r in reply["results"]] == [(1, True), (2, False), (3, True), (4, False)]
    assert reply["results"][1]["reason"] == "too_large" and reply["results"][3]["retry"]  # the queue holds 2
    assert not mismatched["ok"] and "one integer request id per group frame" in mismatched["error"]
    assert [g.group_id for g in taken] == ["abc", "abc"]
    assert server.rejected == {"too_large": 1, "malformed": 1}


def test_a_generator_can_release_only_admissions_it_holds_whatever_it_asks(server):
    """`release` (a group its own dynamic-sampling filter dropped): the capacity returns at once; a hostile count
    frees nothing it did not take."""
    client = ZmqBufferClient(server.endpoint, "gen-r", timeout_s=5)
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.connect(server.endpoint)

    def raw_release(count):
        raw.send_multipart([pack({"op": "release", "req": 1, "gen": "gen-r", "count": count})])
        assert raw.poll(5000)
        return msgpack.unpackb(raw.recv_multipart()[-1])

    async def scenario():
        granted = (await client.admit(10)).granted
        full = (await client.admit(1)).granted
        await client.release(1)
        return granted, full, (await client.admit(10)).granted

    try:
        assert run(scenario()) == (4, 0, 1)  # (η + v + 1) * B = 4; one released, one more admitted
        assert [raw_release(count)["released"] for count in ("x", -2, 0)] == [0, 0, 0]
        assert raw_release(10 ** 9)["released"] == 4  # all it holds, and no more
        assert server.coordinator.started == 0 and run(client.admit(10)).granted == 4
    finally:
        raw.close(linger=0)
        context.term()
        client.close()


@pytest.mark.parametrize("weights, named", [
    ({"version": 2, "names": ["w"]}, "field 'publisher' is missing"),
    ({**announcement(2).to_wire(), "shapes": [[4, "x"]]}, "field 'shapes'"),
    ({**announcement(2).to_wire(), "checksums": []}, "1 buckets but 0 checksums"),
    ([1, 2], "not a mapping"),
])
def test_a_malformed_weights_announcement_fails_the_request_naming_the_learner_and_the_field(weights, named):
    """A generator reads the announcement off the network: one that is malformed fails the request that carried it
    with an AnnouncementError naming the learner and what is wrong, never a KeyError in the rollout loop."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    client = ZmqBufferClient(f"tcp://127.0.0.1:{port}", "gen-w", timeout_s=5)

    def serve_one():
        assert router.poll(5000)
        identity, header = router.recv_multipart()
        router.send_multipart([identity, pack({"req": msgpack.unpackb(header)["req"], "ok": True, "version": 2,
                                               "weights_id": "w1", "weights": weights, "done": False})])

    async def scenario():
        server = asyncio.create_task(asyncio.to_thread(serve_one))
        try:
            with pytest.raises(AnnouncementError, match=f"learner at tcp://127.0.0.1:{port}.*{named}"):
                await client.admit(1)
        finally:
            await server

    try:
        asyncio.run(scenario())
        assert client.weights is None and client.weights_id == ""  # asked again with the next request
    finally:
        client.close()
        router.close(linger=0)
        context.term()
