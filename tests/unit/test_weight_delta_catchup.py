"""Catch-up sends what changed: delta.py's encoding is bit-exact and refuses hostile input, and the catch-up server
answers a generator that names the version it holds with only the changes, falling back to the full version when
the base is gone from the ring, is another learner life's bytes, or the delta would not be smaller."""
import contextlib
import dataclasses
import time

import numpy as np
import pytest
import torch

from asyncrl.weightsync import delta
from asyncrl.weightsync.announcement import ShmRingPlace
from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.catchup import CatchupServer
from asyncrl.weightsync.layout import plan_layout
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage


def tensors(seed: int) -> list:
    torch.manual_seed(seed)
    return [("embed.weight", torch.randn(64, 32).to(torch.bfloat16)), ("layer.w", torch.randn(32, 32)),
            ("norm.weight", torch.ones(32, dtype=torch.bfloat16)), ("positions", torch.arange(10)),
            ("mask", torch.tensor([True, False, True])), ("big", torch.randn(20000))]


def specs(named):
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in named]


def flat(named, bucket_bytes=2048) -> FlatBuckets:
    layout = plan_layout(specs(named), bucket_bytes)  # zeroed, like a ring: padding between tensors compares equal
    buckets = FlatBuckets(layout, [torch.zeros(size, dtype=torch.uint8) for size in layout.bucket_sizes])
    for name, tensor in named:
        buckets.put(name, tensor)
    return buckets


def stepped(named, changed: dict) -> list:
    """`named` with some elements moved: {name: flat indices}."""
    out = []
    for name, tensor in named:
        tensor = tensor.clone()
        if name in changed:
            flat_view = tensor.view(-1)
            flat_view[changed[name]] = flat_view[changed[name]] + (1 if not tensor.is_floating_point() else 0.5)
        out.append((name, tensor))
    return out


def same_bytes(a: FlatBuckets, b: FlatBuckets) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.buffers, b.buffers))


def test_a_delta_reproduces_the_target_bit_for_bit_in_the_cheapest_encoding():
    old = tensors(0)
    new = stepped(old, {"embed.weight": [3, 70, 1000], "positions": [2], "layer.w": list(range(0, 1024, 2)),
                        "big": [15000]})
    new[2][1].view(-1)[5] = float("nan")  # bits, not values: a NaN and a -0.0 are changes like any other
    new[2][1].view(-1)[6] = -0.0
    base, target = flat(old), flat(new)
    entries, frames = delta.encode(base, target, max_fraction=1.0)
    kinds = {target.layout.entries[i].name: (kind, count) for i, kind, count in entries}
    assert kinds["embed.weight"] == ("gap", 6)  # 930 from 70 to 1000: three unchanged elements bridge it
    assert kinds["positions"] == ("gap", 1) and kinds["norm.weight"] == ("gap", 2)
    assert kinds["layer.w"] == ("mask", 512)  # half the elements: a bitmap beats any list of positions
    assert kinds["big"] == ("idx", 1)  # one change 15000 elements in: a 4-byte index beats 58 bridges
    assert "mask" not in kinds  # unchanged tensors are left out
    dest = flat(old)
    delta.apply(dest, entries, [bytes(frame.numpy()) for frame in frames])
    assert same_bytes(dest, target)
    assert delta.nbytes(frames) == 6 * 3 + (1 + 8) + 2 * 3 + (128 + 512 * 4) + (4 + 4)


def test_bridging_keeps_every_gap_within_a_byte():
    positions = np.array([0, 255, 256, 1000, 5000])
    bridged = delta._bridged(positions)
    assert set(positions) <= set(bridged) and np.all(np.diff(np.concatenate(([-1], bridged))) <= delta.MAX_GAP)
    assert np.all(np.diff(bridged) > 0) and len(bridged) == 5 + (743 - 1) // 255 + (3999 - 1) // 255
    assert np.array_equal(delta._bridged(np.array([10, 20])), [10, 20])


def test_no_delta_when_it_would_not_pay_or_the_layouts_differ():
    old = tensors(0)
    everything = [(name, t + 1 if t.dtype != torch.bool else ~t) for name, t in old]
    assert delta.encode(flat(old), flat(everything), max_fraction=0.5) is None
    other = flat(old + [("extra", torch.zeros(4))])
    assert delta.encode(flat(old), other) is None
    entries, frames = delta.encode(flat(old), flat(old))
    assert entries == [] and frames == []
    empty = old + [("empty", torch.zeros(0))]  # a tensor of no elements changes nothing and costs nothing
    assert delta.encode(flat(empty), flat(empty)) == ([], [])


@pytest.mark.parametrize("tamper, error", [
    (lambda e, f: (e, f[:-1]), "frames"),
    (lambda e, f: ([[99, "idx", 1]], f[:2]), "malformed"),
    (lambda e, f: ([[e[0][0], "zip", 1]], f[:2]), "malformed"),
    (lambda e, f: ([[e[0][0], "idx", 2]], f[:2]), "value bytes"),
    (lambda e, f: (e[2:3], [np.array([10**6], dtype=np.int32).tobytes(), f[5]]), "outside"),
    (lambda e, f: (e[2:3], [np.array([-1], dtype=np.int32).tobytes(), f[5]]), "outside"),
    (lambda e, f: (e[2:3], [f[4][:-1], f[5]]), "index bytes"),
    (lambda e, f: (e[1:2], [f[2][:-1], f[3]]), "bitmap"),
    (lambda e, f: (e[1:2], [bytes(len(f[2])), f[3]]), "marks"),
    (lambda e, f: (e[:1], [bytes([0]), f[1]]), "repeat"),
    (lambda e, f: ([[e[0][0], "gap", 9]], [bytes([255]) * 9, bytes(18)]), "run past"),  # 2295 of 2048
])
def test_a_hostile_delta_is_refused_before_a_byte_is_written(tamper, error):
    old = tensors(0)
    new = stepped(old, {"embed.weight": [3], "layer.w": list(range(0, 1024, 2)), "big": [15000]})
    entries, frames = delta.encode(flat(old), flat(new), max_fraction=1.0)
    assert [kind for _, kind, _ in entries] == ["gap", "mask", "idx"]
    entries, frames = tamper(entries, [bytes(frame.numpy()) for frame in frames])
    dest = flat(old)
    with pytest.raises(delta.DeltaError, match=error):
        delta.apply(dest, entries, frames)
    assert same_bytes(dest, flat(old))


@contextlib.contextmanager
def remote_job(tmp_path, **server_options):
    """The learner's publisher and catch-up server, and a generator's stage that cannot map the learner's ring."""
    server = CatchupServer("127.0.0.1", 0, **server_options)
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=3, bucket_bytes=2048, catchup=server)
    stage = WeightStage(str(tmp_path), "remote")
    try:
        yield server, publisher, stage
    finally:
        stage.close()
        publisher.close()


def publish(publisher, named, version):
    return publisher.publish(iter(named), version, specs(named))


def remote(message, tmp_path):
    return dataclasses.replace(message, shm=ShmRingPlace(str(tmp_path / "not-on-this-host"), "other", 3))


def test_catch_up_sends_only_what_changed_since_the_version_the_generator_holds(tmp_path):
    with remote_job(tmp_path) as (server, publisher, stage):
        v1 = tensors(0)
        staged = stage.stage(remote(publish(publisher, v1, 1), tmp_path))  # nothing held: the full version
        stage.end_load(staged, ok=True)
        assert stage.paths_used["catchup"] == 1 and stage.paths_used["catchup_delta"] == 0
        full = server.sent_bytes
        v2 = stepped(v1, {"embed.weight": [1, 2, 3]})
        staged = stage.stage(remote(publish(publisher, v2, 2), tmp_path))
        stage.end_load(staged, ok=True)
        assert stage.paths_used["catchup_delta"] == 1 and same_bytes(staged.buckets, flat(v2))
        assert server.sent_bytes - full == 3 * (1 + 2) and server.deltas_served == 1  # gaps 2, 1, 1 and 3 bf16
        # the base v2 is evicted by v3..v5 (3 slots): v5 comes whole
        for version in (3, 4):
            publish(publisher, stepped(v2, {"layer.w": [version]}), version)
        v5 = stepped(v2, {"layer.w": [5]})
        staged = stage.stage(remote(publish(publisher, v5, 5), tmp_path))
        stage.end_load(staged, ok=True)
        assert stage.paths_used["catchup_delta"] == 1 and same_bytes(staged.buckets, flat(v5))


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_next_delta_is_encoded_before_the_fleet_asks_and_only_while_it_asks(tmp_path):
    with remote_job(tmp_path) as (server, publisher, stage):
        v1 = tensors(0)
        stage.end_load(stage.stage(remote(publish(publisher, v1, 1), tmp_path)), ok=True)
        message = publish(publisher, stepped(v1, {"layer.w": [2]}), 2)
        time.sleep(0.3)
        assert server.deltas_prepared == 0  # no delta served yet: nobody follows through catch-up
        stage.end_load(stage.stage(remote(message, tmp_path)), ok=True)
        assert server.deltas_served == 1 and server.prepared_used == 0
        v3 = stepped(v1, {"layer.w": [3], "big": [7]})
        message = publish(publisher, v3, 3)
        wait_for(lambda: server.deltas_prepared == 1)  # v2 -> v3, before anyone asked
        staged = stage.stage(remote(message, tmp_path))
        stage.end_load(staged, ok=True)
        assert server.prepared_used == 1 and stage.paths_used["catchup_delta"] == 2 and same_bytes(staged.buckets,
                                                                                                      flat(v3))
        publish(publisher, stepped(v3, {"layer.w": [4]}), 4)
        wait_for(lambda: server.deltas_prepared == 2)  # v3 -> v4, which nobody asks for
        v5 = stepped(v3, {"layer.w": [5]})
        message = publish(publisher, v5, 5)
        time.sleep(0.3)
        assert server.deltas_prepared == 2  # the unasked v3 -> v4 stopped the preparing
        staged = stage.stage(remote(message, tmp_path))  # v3 -> v5, encoded on demand
        stage.end_load(staged, ok=True)
        assert server.deltas_served == 3 and server.prepared_used == 1 and same_bytes(staged.buckets, flat(v5))
        publish(publisher, stepped(v5, {"layer.w": [6]}), 6)
        wait_for(lambda: server.deltas_prepared == 3)  # a delta served again: preparing resumes (v5 -> v6)


def test_a_restarted_learners_same_version_number_is_not_a_base(tmp_path):
    """A resumed learner publishes v1 again with other bytes: the generator's v1 is not its v1."""
    stage = WeightStage(str(tmp_path), "remote")
    first_server = CatchupServer("127.0.0.1", 0)
    first = WeightPublisher(str(tmp_path / "ring1"), slots=3, bucket_bytes=2048, catchup=first_server)
    try:
        staged = stage.stage(remote(publish(first, tensors(0), 1), tmp_path))
        stage.end_load(staged, ok=True)
    finally:
        first.close()
    server = CatchupServer("127.0.0.1", 0)
    second = WeightPublisher(str(tmp_path / "ring2"), slots=3, bucket_bytes=2048, catchup=server)
    try:
        publish(second, tensors(1), 1)
        v2 = stepped(tensors(1), {"layer.w": [0]})
        staged = stage.stage(remote(publish(second, v2, 2), tmp_path))
        assert same_bytes(staged.buckets, flat(v2))
        assert stage.paths_used["catchup_delta"] == 0 and server.deltas_served == 0
    finally:
        stage.close()
        second.close()


def test_a_server_told_to_send_full_copies_never_sends_a_delta(tmp_path):
    with remote_job(tmp_path, delta_max_fraction=0) as (server, publisher, stage):
        stage.end_load(stage.stage(remote(publish(publisher, tensors(0), 1), tmp_path)), ok=True)
        staged = stage.stage(remote(publish(publisher, stepped(tensors(0), {"layer.w": [1]}), 2), tmp_path))
        assert same_bytes(staged.buckets, flat(stepped(tensors(0), {"layer.w": [1]})))
        assert server.deltas_served == 0 and server.sent_bytes == 2 * staged.announcement.nbytes


def test_a_delta_that_fails_its_checksums_is_followed_by_the_full_version(tmp_path):
    """The generator's copy of the base is not what the server's digest says (here: corrupted after staging), so
    the patched result fails the checksums: stage asks again for the whole version and never hands on bad bytes."""
    with remote_job(tmp_path) as (server, publisher, stage):
        v1 = tensors(0)
        staged = stage.stage(remote(publish(publisher, v1, 1), tmp_path))
        stage.end_load(staged, ok=True)
        staged.buckets.buffers[0][0] ^= 1
        v2 = stepped(v1, {"embed.weight": [1, 2, 3]})
        staged = stage.stage(remote(publish(publisher, v2, 2), tmp_path))
        assert same_bytes(staged.buckets, flat(v2))
        assert server.deltas_served == 1 and server.served == 3  # the delta, then the whole version
        assert stage.paths_used["catchup"] == 2 and stage.paths_used["catchup_delta"] == 0
