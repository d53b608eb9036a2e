"""Weight sync's control plane and shared-memory data plane, in one process: the layout and its message, buckets
reused across versions, the persistent ring's seqlock, the publisher, catch-up, and staging that never hands on a
version it has not verified whole."""
import dataclasses
import json
import os

import msgpack
import pytest
import torch

from asyncrl.weightsync.catchup import CatchupError, CatchupServer, fetch
from asyncrl.weightsync.announcement import AnnouncementError, BroadcastPlace, ShmRingPlace, WeightsAnnouncement
from asyncrl.weightsync.layout import ALIGN, LayoutError, announcement_for, layout_of, plan_layout
from asyncrl.weightsync.publisher import PublishError, WeightPublisher
from asyncrl.weightsync.receiver import WeightStage, WeightSyncError
from asyncrl.weightsync.shm_ring import RingError, ShmRing
from tests.weightsync_tensors import model_tensors, publish, specs_of


def test_layout_packs_aligned_buckets_and_survives_its_announcement():
    tensors = model_tensors(0)
    layout = plan_layout(specs_of(tensors), bucket_bytes=4096)
    assert all(e.offset % ALIGN == 0 for e in layout.entries)
    assert layout.bucket_sizes[0] <= 4096 and len(layout.bucket_sizes) == 3  # 3200, 1024+12+32, 3200 bytes
    message = announcement_for(layout, 7, ["x"] * len(layout.bucket_sizes), publisher="life", published_at=0.0)
    assert layout_of(message) == layout and message.version == 7 and message.nbytes == layout.total_bytes
    big = plan_layout([("huge", "float32", (2000,))], bucket_bytes=1024)  # larger than a bucket: its own
    assert big.bucket_sizes == (8000,)
    with pytest.raises(LayoutError, match="does not fit"):
        layout_of(dataclasses.replace(message, offsets=(0, 0, 0, 0, 100000)))
    with pytest.raises(LayoutError, match="fingerprint"):
        layout_of(dataclasses.replace(message, shapes=((50, 16), (16, 16), (3,), (16,), (49, 16))))
    with pytest.raises(LayoutError, match="'complex64'"):
        layout_of(dataclasses.replace(message, dtypes=("complex64",) * 5))


def test_an_announcement_survives_msgpack_and_json_and_a_malformed_one_is_named():
    layout = plan_layout(specs_of(model_tensors(0)), bucket_bytes=4096)
    message = announcement_for(layout, 3, ["ab"] * len(layout.bucket_sizes), publisher="life", published_at=1.5,
                               shm=ShmRingPlace("/dev/shm/r", "host", 3), catchup="tcp://h:1",
                               broadcast=BroadcastPlace("h:2", "gloo"), engines="h:3", lora={"r": 4})
    for wire in (msgpack.unpackb(msgpack.packb(message.to_wire())), json.loads(json.dumps(message.to_wire()))):
        assert WeightsAnnouncement.from_wire(wire) == message
    plain = announcement_for(layout, 3, ["ab"] * len(layout.bucket_sizes), publisher="life", published_at=1.5)
    assert WeightsAnnouncement.from_wire(plain.to_wire()) == plain and plain.shm is None and plain.catchup == ""
    wire = message.to_wire()
    for broken, named in (({**wire, "version": "3"}, "field 'version'"), ({**wire, "names": wire["names"][1:]},
                                                                           "5 dtypes for 4 names"),
                          ({**wire, "shm": {"path": "/x"}}, "field 'shm'"), ({**wire, "nbytes": 1}, "nbytes 1"),
                          ({**wire, "broadcast": "h:2"}, "field 'broadcast'"), ({**wire, "lora": [4]}, "'lora'")):
        with pytest.raises(AnnouncementError, match=f"weights v3|{named}") as caught:
            WeightsAnnouncement.from_wire(broken)
        assert named in str(caught.value)


def test_publisher_writes_versions_in_place_and_staging_copies_them_verified(tmp_path):
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=3, bucket_bytes=4096)
    stage = WeightStage(str(tmp_path), "gen")
    try:
        first = publish(publisher, model_tensors(1), 1)
        ring_inode = os.stat(publisher.ring_path).st_ino
        second = publish(publisher, model_tensors(2), 2)
        assert os.stat(publisher.ring_path).st_ino == ring_inode  # the mapping is reused, not recreated
        staged = stage.stage(second)
        got = dict(staged.buckets.tensors())
        for name, tensor in model_tensors(2):
            assert torch.equal(got[name], tensor)
        assert stage.paths_used["shm"] == 1 and staged.version == 2
        stage.end_load(staged, ok=True)
        assert stage.good.slot == staged.slot
        again = stage.stage(first)  # an older version still in the ring, into another slot
        assert again.slot != staged.slot
        stage.end_load(again, ok=False)
        assert stage.good is staged  # a failed load keeps the last good version pinned
    finally:
        stage.close()
        publisher.close()


def test_a_slot_overwritten_while_read_is_detected(tmp_path):
    tensors = model_tensors(3)
    layout = plan_layout(specs_of(tensors), 4096)
    writer = ShmRing(str(tmp_path / "r"), layout, 2, create=True)
    reader = ShmRing(str(tmp_path / "r"), layout, 2, create=False)
    writer.begin_write(1)
    writer.end_write(1, 5)
    assert reader.find(5) == 1 and reader.find(4) is None
    writer.begin_write(1)  # the learner reuses the slot
    assert reader.find(5) is None  # odd sequence: not complete
    with pytest.raises(RingError, match="no longer"):
        reader.copy_out(5, writer.buckets(0))
    other = plan_layout([("x", "float32", (3,))], 4096)
    with pytest.raises(RingError, match="another layout|bytes"):
        ShmRing(str(tmp_path / "r"), other, 2, create=False)
    reader.close()
    writer.close(unlink=True)


def test_fp32_weights_are_cast_to_the_published_dtype_by_the_ring_copy(tmp_path):
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=2, bucket_bytes=4096)
    stage = WeightStage(str(tmp_path), "gen")
    try:
        tensors = model_tensors(5)
        specs = [(name, "bfloat16", shape) for name, _, shape in specs_of(tensors)]
        staged = stage.stage(publisher.publish(iter(tensors), 1, specs))
        got = dict(staged.buckets.tensors())
        for name, tensor in tensors:  # the same rounding as a separate .to(bfloat16)
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor.to(torch.bfloat16))
        stage.end_load(staged, ok=True)
        with pytest.raises(PublishError, match="layer.0.b"):  # a cast never hides a wrong shape
            publisher.publish(iter([(n, t if n != "layer.0.b" else torch.zeros(4)) for n, t in tensors]), 2, specs)
        ints = [("ids", torch.arange(4))]
        with pytest.raises(PublishError, match="ids"):  # nor turns integers into floats
            publisher.publish(iter(ints), 3, [("ids", "float32", (4,))])
    finally:
        stage.close()
        publisher.close()


def test_publish_refuses_missing_or_unknown_tensors(tmp_path):
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=2, bucket_bytes=4096)
    tensors = model_tensors(4)
    with pytest.raises(PublishError, match="never arrived"):
        publisher.publish(iter(tensors[:-1]), 1, specs_of(tensors))
    with pytest.raises(PublishError, match="not in the layout"):
        publisher.publish(iter(tensors + [("extra", torch.zeros(2))]), 1, specs_of(tensors))
    publisher.close()


def test_catch_up_serves_the_newest_version_to_another_host(tmp_path):
    server = CatchupServer("127.0.0.1", 0)
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=2, bucket_bytes=4096, catchup=server)
    stage = WeightStage(str(tmp_path), "remote")
    try:
        publish(publisher, model_tensors(5), 1)
        message = publish(publisher, model_tensors(6), 2)
        remote = dataclasses.replace(message, shm=ShmRingPlace(str(tmp_path / "not-on-this-host"), "other", 2))
        staged = stage.stage(remote)
        assert stage.paths_used == {"broadcast": 0, "shm": 0, "catchup": 1, "catchup_delta": 0}
        assert torch.equal(dict(staged.buckets.tensors())["layer.0.w"], model_tensors(6)[1][1])
        with pytest.raises(CatchupError, match="not held"):
            fetch(server.address, 0, lambda m: staged.buckets, 5)
    finally:
        stage.close()
        publisher.close()


def test_staging_never_hands_on_bytes_that_fail_their_checksums(tmp_path):
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=2, bucket_bytes=4096)
    stage = WeightStage(str(tmp_path), "gen")
    try:
        message = publish(publisher, model_tensors(7), 1)
        publisher.ring.buckets(1).buffers[0][5] += 1  # corrupt the learner's copy after publishing
        with pytest.raises(WeightSyncError, match="checksums"):
            stage.stage(message)
        assert stage.loading is None  # the slot was released
    finally:
        stage.close()
        publisher.close()


def test_catch_up_times_out_naming_the_server():
    with pytest.raises(CatchupError, match="tcp://127.0.0.1:9 did not answer"):
        fetch("tcp://127.0.0.1:9", 3, lambda m: None, timeout_s=0.3)


def test_mappings_of_dead_processes_are_removed_by_the_next_one(tmp_path):
    """A learner or generator killed with -9 leaves its mapping in /dev/shm; the next one on the host removes it
    (and only files of processes that are gone)."""
    from asyncrl.weightsync.backends import make_publisher
    from asyncrl.weightsync.config import WeightSyncConfig

    with open("/proc/sys/kernel/pid_max") as handle:
        dead = handle.read().strip()  # pids are below pid_max: no process ever has this one
    for name in (f"asyncrl-job-{dead}.ring", f"asyncrl-stage-gen-{dead}", f"asyncrl-job-{os.getppid()}.ring",
                 "asyncrl-other-1.ring"):
        (tmp_path / name).write_bytes(b"x")
    publisher = make_publisher(WeightSyncConfig(shm_dir=str(tmp_path)), "job")
    stage = WeightStage(str(tmp_path), "gen")
    left = sorted(os.listdir(tmp_path))
    publisher.close()
    stage.close()
    assert f"asyncrl-job-{dead}.ring" not in left and f"asyncrl-stage-gen-{dead}" not in left
    assert f"asyncrl-job-{os.getppid()}.ring" in left and "asyncrl-other-1.ring" in left  # alive, or another job


def test_the_learner_warns_when_generators_reach_the_buffer_but_not_the_catch_up_server():
    """A zmq buffer beyond loopback with the catch-up server on it: a generator in another machine or network
    namespace that falls behind the ring could never load weights (the soak found it: 60 s waits, stale weights)."""
    from asyncrl.buffer.config import BufferConfig
    from asyncrl.learner.host import unreachable_weight_servers
    from asyncrl.weightsync.config import WeightSyncConfig

    warning = unreachable_weight_servers(BufferConfig(host="10.0.0.1"), WeightSyncConfig())
    assert "weightsync.host=10.0.0.1" in warning and "127.0.0.1" in warning
    assert unreachable_weight_servers(BufferConfig(), WeightSyncConfig()) is None  # all on one machine
    assert unreachable_weight_servers(BufferConfig(host="10.0.0.1"), WeightSyncConfig(host="10.0.0.1")) is None
    assert unreachable_weight_servers(BufferConfig(host="0.0.0.0"),
                                      WeightSyncConfig(host="0.0.0.0", advertise="learner-1")) is None
    assert unreachable_weight_servers(BufferConfig(host="10.0.0.1"), WeightSyncConfig(advertise="learner-1")) is None
