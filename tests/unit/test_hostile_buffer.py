"""The embedded ZeroMQ buffer against generators that break the rules, over real sockets: groups sent without an
admission or after the admissions were reclaimed never free capacity (a property test), a group must carry its
connection's generator id, an oversized group is answered at any size, the queue is bounded in bytes, stats
reports are validated, a dead generator's stats stop counting, and rejections are logged at a bounded rate."""
import asyncio
import logging
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.dealing import PromptDealer
from asyncrl.buffer.eval_rounds import EvalRounds
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.buffer.interface import GeneratorRefused
from asyncrl.buffer.plausibility import JobLimits
from asyncrl.telemetry.rejections import RejectionLog
from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.client import ZmqBufferClient
from asyncrl.buffer.zmq.server import ZmqBufferServer
from asyncrl.data.prompts import encode_prompts
from tests.dealt_rows import Row
from tests.conftest import free_port
from tests.raw_peer import RawPeer
from tests.messages import run_info

ETA, B = 1, 2
LIMITS = JobLimits(group_size=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, max_completion_tokens=16,
                   max_prompt_tokens=8, max_positions=64)
"""What `group` produces: one sample per group, sampled at temperature 1 with Sampling's other defaults."""


def group(gen: str, temperature: float = 1.0, completion: int = 2) -> Group:
    sample = Sample(completion_ids=np.full(completion, 3, np.int32), logprobs=np.full(completion, -0.5, np.float32),
                    versions=np.zeros(completion, np.int32), reward=1.0, finish_reason="stop")
    return Group(group_id=uuid.uuid4().hex, prompt_id="p0", generator_id=gen, prompt_ids=np.array([1, 2], np.int32),
                 samples=[sample], sampling=Sampling(temperature), created_at=time.time())


def make_server(**overrides) -> ZmqBufferServer:
    options = dict(vocab_size=16, config_hash="h", max_message_bytes=4096, queue_groups=64, run_info=run_info(),
                   limits=LIMITS)
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(ETA, B), **(options | overrides))
    server.start()
    return server


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.sampled_from("abc"), st.integers(1, 5)),
    st.tuples(st.just("send"), st.sampled_from("abc"), st.booleans()),  # (valid or not)
    st.tuples(st.just("leave"), st.sampled_from("abc")),  # its admissions are reclaimed; it may keep sending
    st.tuples(st.just("take")),
), min_size=1, max_size=40)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_admission_never_exceeds_the_bound_under_unrequested_groups_and_reclaimed_generators(ops):
    """A model of the rule: every admission is freed at most once (its group rejected, or its generator gone), a
    group that held none frees nothing, and the groups in flight never exceed (η + v + 1)·B. If every rejected group
    freed one admission, ten unrequested bad groups would let ten more start."""
    server = make_server()
    peers = {gen: RawPeer(server.endpoint, gen) for gen in "abc"}
    outstanding = dict.fromkeys("abc", 0)  # admissions each generator holds (the model)
    queue = []  # (valid, held an admission) of the groups waiting for the learner
    started = trained = version = 0
    try:
        for op in ops:
            if op[0] == "admit":
                granted = peers[op[1]].ask("admit", want=op[2])["granted"]
                assert granted == min(op[2], max(0, (ETA + version + 1) * B - started))
                started += granted
                outstanding[op[1]] += granted
            elif op[0] == "send":
                gen, valid = op[1], op[2]
                payload = encode_group(group(gen, temperature=1.0 if valid else 0.0))
                assert peers[gen].ask("group", payload)["accepted"]
                queue.append((valid, outstanding[gen] > 0))
                outstanding[gen] = max(0, outstanding[gen] - 1)
            elif op[0] == "leave":
                peers[op[1]].ask("bye")
                started -= outstanding[op[1]]
                outstanding[op[1]] = 0
            else:
                wait_until(lambda: server.queued() == len(queue))  # replies go out just before groups are queued
                taken = server.take(2.0 if any(valid for valid, _ in queue) else 0.05)
                found = False
                while queue and not found:
                    found, held = queue.pop(0)
                    if not found:
                        started -= held  # a rejected group frees its admission only if it held one
                assert (taken is not None) == found
                if found:
                    trained += 1
                    if trained == (version + 1) * B:
                        version += 1
                        server.set_version(version)
            assert server.coordinator.started == started, op
            assert started <= (ETA + version + 1) * B
    finally:
        for peer in peers.values():
            peer.close()
        server.close()


def test_a_group_must_carry_its_connections_generator_id():
    server = make_server()
    peer = RawPeer(server.endpoint, "honest")
    try:
        assert peer.ask("admit", want=1)["granted"] == 1
        assert peer.ask("group", encode_group(group("someone-else")))["accepted"]
        assert server.take(0.3) is None
        told = peer.ask("admit", want=1)
    finally:
        peer.close()
        server.close()
    assert server.rejected == {"generator_id": 1}
    assert "'someone-else' sent by 'honest'" in told["rejected"]["last_error"]
    assert server.coordinator.started == 1  # the rejected group gave its admission back; the second admit took one


def test_an_oversized_group_is_answered_too_large_beyond_the_limit_plus_a_mib():
    """libzmq dropped a message over its own limit (the application's plus 1 MiB) unanswered; now the transport
    allows twice the application's, so the server answers and counts it, and the project's client answers any size
    itself without sending."""
    limit = 1 << 20
    server = make_server(max_message_bytes=limit)
    peer = RawPeer(server.endpoint, "big")
    client = ZmqBufferClient(server.endpoint, "big-client", timeout_s=5, max_message_bytes=limit)
    try:
        reply = peer.ask("group", b"\x00" * (limit + (3 << 19)))  # the limit + 1.5 MiB
        local = asyncio.run(client.send("g", b"\x00" * (64 << 20)))
        still_serving = peer.ask("admit", want=1)
    finally:
        client.close()
        peer.close()
        server.close()
    assert reply["accepted"] is False and reply["reason"] == "too_large"
    assert local.reason == "too_large" and f"max_message_bytes={limit}" in local.error
    assert server.rejected == {"too_large": 1} and still_serving["ok"]


def test_the_queue_is_bounded_in_bytes_as_well_as_groups():
    one = len(encode_group(group("g", completion=200)))
    server = make_server(queue_bytes=3 * one, limits=None)
    peer = RawPeer(server.endpoint, "g")
    try:
        replies = [peer.ask("group", encode_group(group("g", completion=200))) for _ in range(4)]
        metrics = server.metrics()
        assert server.take(2.0) is not None
        after = peer.ask("group", encode_group(group("g", completion=200)))
    finally:
        peer.close()
        server.close()
    assert [r["accepted"] for r in replies] == [True, True, True, False] and replies[3]["retry"]
    assert metrics["buffer/size"] == 3 and metrics["buffer/size_bytes"] == 3 * one
    assert after["accepted"]  # room again once the learner took one


@pytest.mark.parametrize("metrics", [{"perf/generator/tokens_per_s": "fast"}, {"x": float("inf")},
                                     {"x": [1, 2]}, [1, 2], {str(i): 1.0 for i in range(300)}, {"": 1.0}])
def test_a_stats_report_that_is_not_a_map_of_finite_numbers_is_dropped_and_counted(metrics):
    """On today's main a string metric crashed the learner when it summed the fleet's throughput."""
    server = make_server()
    peer = RawPeer(server.endpoint, "g")
    try:
        good = peer.ask("stats", metrics={"perf/generator/tokens_per_s": 10.0})
        bad = peer.ask("stats", metrics=metrics)
        summed = server.metrics()
    finally:
        peer.close()
        server.close()
    assert good["ok"] and not bad["ok"] and "stats rejected" in bad["error"]
    assert summed["buffer/rejected/stats"] == 1.0
    assert summed["perf/generator/tokens_per_s"] == 10.0  # the last good report stands


def test_a_dead_generators_stats_stop_counting_even_while_the_others_keep_the_server_busy():
    server = make_server(peer_timeout_s=0.3)
    alive, dead = RawPeer(server.endpoint, "alive"), RawPeer(server.endpoint, "dead")
    try:
        for peer in (alive, dead):
            peer.ask("stats", metrics={"perf/generator/tokens_per_s": 100.0})
        before = server.metrics()["perf/generator/tokens_per_s"]
        deadline = time.monotonic() + 5
        while "dead" in server.generator_stats and time.monotonic() < deadline:  # the server is never idle
            alive.ask("stats", metrics={"perf/generator/tokens_per_s": 100.0})
            time.sleep(0.02)
        after = server.metrics()["perf/generator/tokens_per_s"]
        forgotten = "dead" not in server.generator_stats
    finally:
        alive.close()
        dead.close()
        server.close()
    assert (before, after) == (200.0, 100.0)
    assert forgotten  # expired while the others kept the server busy (on today's main it never was)


def test_rejection_warnings_are_rate_limited_with_a_count(caplog):
    now = [0.0]
    rejections = RejectionLog(logging.getLogger("test.rejections"), "group", every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.rejections"):
        for second in range(25):
            now[0] = float(second)
            for _ in range(100):
                rejections.reject("sampling", "gen-x", "sampling: temperature 0")
        rejections.reject("empty", "gen-y", "prompt_ids: the prompt is empty")
    lines = [record.getMessage() for record in caplog.records]
    assert rejections.snapshot() == {"sampling": 2500, "empty": 1}
    assert len(lines) == 4, lines  # sampling at 0 s, 10 s and 20 s, and the first empty one
    assert "rejected group from gen-x (sampling)" in lines[0]
    assert "rejected group 1000 times (sampling) in the last 10 s" in lines[1]
    assert "from gen-y (empty)" in lines[3]


def test_a_config_mismatch_is_one_line_naming_the_keys_that_differ():
    """It was a 27-line traceback naming neither the section nor the key."""
    from asyncrl.configs import load_config, shared_hash, shared_sections
    from asyncrl.generator.main import join_learner

    learner_cfg = load_config(None, ["rollout.n=4", "reward.overlong_buffer_len=2", "job.seed=3"])
    generator_cfg = load_config(None, ["rollout.n=8", "job.name=elsewhere"])  # the job's name may differ
    server = make_server(config_hash=shared_hash(learner_cfg), shared_config=shared_sections(learner_cfg))
    client = ZmqBufferClient(server.endpoint, "gen-m", timeout_s=5)
    try:
        with pytest.raises(GeneratorRefused) as refused:
            asyncio.run(join_learner(client, generator_cfg, say=lambda message: None))
    finally:
        client.close()
        server.close()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"config mismatch with the learner at {server.endpoint}")
    assert "rollout.n (this generator 8, the learner 4)" in message
    assert "reward.overlong_buffer_len (this generator 0, the learner 2)" in message
    assert "job.seed (this generator 0, the learner 3)" in message and "job.name" not in message


def test_a_generator_whose_learner_only_settings_differ_joins():
    """buffer.done_grace_s (and the other LEARNER_ONLY_KEYS) sit in shared sections but only the learner reads them:
    a generator that does not repeat them used to be refused for a config mismatch."""
    from asyncrl.configs import load_config, shared_hash, shared_sections
    from asyncrl.generator.main import join_learner

    learner_cfg = load_config(None, ["buffer.done_grace_s=5", "buffer.queue_groups=70", "data.epochs=2",
                                     "data.deal_timeout_s=30", "weightsync.keep_versions=5",
                                     "weightsync.catchup_port=5999", "weightsync.bucket_mb=16"])
    generator_cfg = load_config(None, [])
    server = make_server(config_hash=shared_hash(learner_cfg), shared_config=shared_sections(learner_cfg))
    client = ZmqBufferClient(server.endpoint, "gen-j", timeout_s=5)
    try:
        hello = asyncio.run(join_learner(client, generator_cfg, say=lambda message: None))
    finally:
        client.close()
        server.close()
    assert hello.run_info is not None
    assert shared_hash(learner_cfg) != shared_hash(load_config(None, ["rollout.n=3"]))  # shared keys still count


def test_a_refusal_whose_config_detail_is_garbage_still_reads_as_one_line():
    """The learner's shared sections arrive over the wire: a section that is not a map, a non-string key or a
    huge value is described, never a crash, and each value is cut to 80 characters."""
    from asyncrl.buffer.interface import GeneratorRefused
    from asyncrl.configs import describe_difference

    assert GeneratorRefused("refused", ["not", "a", "map"]).learner_config is None
    line = describe_difference({"rollout": {"n": 8}}, {"rollout": [1, 2], 3: {"x": 1}, "data": {"p": "y" * 10_000}})
    assert "\n" not in line and len(line) < 400
    assert "rollout.n (this generator 8, the learner '<unset>')" in line and "3.x" in line


@pytest.mark.parametrize("fields", [{"want": -5}, {"want": "all"}, {"want": 1e9}, {"want": True}, {"want": 0},
                                    {"want": 4, "ver": -7}, {"want": 4, "ver": "0"}, {"want": 4, "ver": 0.0}])
def test_an_admit_with_malformed_fields_is_refused_and_counted_not_coerced(fields):
    """A want of -5, "all" or 1e9 used to be read as 1 and granted a deal; a ver of -7 was dealt the v0 evaluation
    round. Each is refused whole (nothing granted, dealt or taken from a round), said in the reply and counted
    under buffer/rejected/malformed; the same generator's well-formed request is then served."""
    prompts = encode_prompts([Row(f"f:{i}", [3, 4]) for i in range(4)])
    evals = EvalRounds(encode_prompts([Row(f"heldout:{i}", [3, 5]) for i in range(4)]), timeout_s=60.0)
    evals.open(0, n=1, temperature=0.0, max_tokens=8)
    server = make_server(dealer=PromptDealer(prompts, shuffle=False, seed=0, epochs=1, timeout_s=60.0), evals=evals)
    peer = RawPeer(server.endpoint, "rogue")
    try:
        refused = peer.ask("admit", **fields)
        served = peer.ask("admit", want=4, ver=0)
        metrics = server.metrics()
    finally:
        peer.close()
        server.close()
    assert refused["ok"] is False and "[malformed]" in refused["error"] and refused["granted"] == 0
    assert "deals" not in refused and "evals" not in refused
    assert metrics["buffer/rejected/malformed"] == 1 and metrics["data/dealt"] == 2
    assert len(served["evals"]) == 2 and len(served["deals"]) == 2  # nothing was taken by the refused request
