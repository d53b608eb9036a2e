"""Device placement of the broadcast group's buckets: NCCL moves GPU memory only, gloo CPU memory only.

A CPU machine cannot run NCCL, so these tests use a strict stand-in for a process group that refuses, as NCCL and
gloo do, a tensor on the wrong device for its backend; the chain code must refuse such buckets itself, with a
message naming them, before posting anything. The publisher must hand a device group the copy it keeps on the
group's device, never the CPU ring ("meta" stands in for the GPU: it has a device type of its own and copies into
it are free). The real NCCL path has not run yet: it needs a GPU (docs/testing.md, "What has run on a GPU").
"""
import dataclasses

import pytest
import torch

from asyncrl.weightsync.announcement import BroadcastPlace
from asyncrl.weightsync.broadcast.chain import PeerError, bucket_device, relay_chain, send_chain
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage

from tests.weightsync_tensors import model_tensors, publish


class StrictGroup:
    """send/recv of a torch.distributed group on `backend`, refusing tensors not on `device_type` (NCCL: "an
    illegal memory access" or "Tensors must be CUDA and dense"; gloo: "unsupported device type")."""

    def __init__(self, backend: str, device_type: str):
        self.backend, self.device_type = backend, device_type
        self.posted = []

    def name(self) -> str:
        return self.backend

    def _post(self, op, tensors, peer, tag):
        for tensor in tensors:
            if tensor.device.type != self.device_type:
                raise RuntimeError(f"{self.backend}: tensors must be on {self.device_type}, got {tensor.device}")
        self.posted.append((op, peer, tag))
        return Done()

    def send(self, tensors, dst, tag):
        return self._post("send", tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._post("recv", tensors, src, tag)


class Done:
    def wait(self, timeout=None):
        return True


def cpu_buckets():
    return [torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)]


def test_the_chain_refuses_cpu_buckets_on_nccl_before_posting_anything():
    group = StrictGroup("nccl", "cuda")
    with pytest.raises(ValueError, match=r"bucket 0 is on cpu, but nccl moves cuda tensors only"):
        send_chain(group, cpu_buckets(), deadline=1e12, first_peer="gen-0")
    with pytest.raises(ValueError, match=r"receive from the learner: bucket 0 is on cpu, but nccl moves cuda"):
        relay_chain(group, 1, cpu_buckets(), deadline=1e12, upstream="the learner", downstream=None)
    assert group.posted == []


def test_the_chain_moves_cpu_buckets_on_gloo():
    group = StrictGroup("gloo", "cpu")
    send_chain(group, cpu_buckets(), deadline=1e12, first_peer="gen-0")
    assert relay_chain(group, 1, cpu_buckets(), deadline=1e12, upstream="the learner", downstream="gen-1") is None
    assert [op for op, _, _ in group.posted] == ["send", "send", "recv", "send", "recv", "send"]


def test_a_late_refusal_by_the_group_is_a_peer_error_naming_the_peer():
    group = StrictGroup("gloo", "meta")  # a group whose backend disagrees with the buckets only at posting time
    with pytest.raises(PeerError, match="to the first chain member gen-0: failed to start"):
        send_chain(group, cpu_buckets(), deadline=1e12, first_peer="gen-0")


def test_bucket_devices_follow_the_backend_and_nccl_without_cuda_is_a_clear_error():
    assert bucket_device("gloo") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="a nccl weight group needs a CUDA device, and this process has none"):
            bucket_device("nccl")
    else:
        assert bucket_device("nccl").type == "cuda"


class DevicePlane:
    """backends.BroadcastPlane's interface, on a device of its own: records where the buckets it was given live."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.sent = []

    def describe(self) -> dict:
        return {"broadcast": BroadcastPlace("127.0.0.1:1", "nccl")}

    def send(self, version, buffers, ready=None, layout=None):
        for k in range(len(buffers)):
            assert ready is None or ready(k, 1e12)
        self.sent.append((version, [(b.device.type, b.data_ptr() if b.device.type == "cpu" else None)
                                    for b in buffers]))

    def close(self):
        pass


def test_a_device_group_is_sent_the_publishers_device_copy_never_the_cpu_ring(tmp_path):
    group = DevicePlane("meta")
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=3, bucket_bytes=4096, plane=group)
    stage = WeightStage(str(tmp_path), "gen")
    try:
        message = publish(publisher, model_tensors(1), 1)
        version, placed = group.sent[0]
        assert version == 1 and len(placed) == len(message.bucket_sizes)
        assert {device for device, _ in placed} == {"meta"}
        staged = stage.stage(dataclasses.replace(message, broadcast=None))  # the ring still holds the version, checksummed
        assert torch.equal(dict(staged.buckets.tensors())["layer.0.w"], model_tensors(1)[1][1])
    finally:
        stage.close()
        publisher.close()


def test_a_cpu_group_is_sent_the_ring_itself(tmp_path):
    group = DevicePlane("cpu")
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=3, bucket_bytes=4096, plane=group)
    try:
        publish(publisher, model_tensors(1), 1)
        ring_pointers = [b.data_ptr() for b in publisher.ring.buckets(1).buffers]
        assert [pointer for _, pointer in group.sent[0][1]] == ring_pointers  # no second copy on a CPU machine
        assert publisher.device_buckets is None
    finally:
        publisher.close()


def test_a_generator_without_cuda_told_of_an_nccl_group_stages_through_another_path(tmp_path):
    """An announcement naming an NCCL group reaches a generator with no GPU (or a hostile one names a backend
    nobody knows): joining fails with a reason, and the version is staged from shared memory all the same."""
    if torch.cuda.is_available():
        pytest.skip("this machine could join an NCCL group")
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=3, bucket_bytes=4096)
    stage = WeightStage(str(tmp_path), "gen")
    try:
        for version, backend in ((2, "nccl"), (3, "mpi")):
            message = publish(publisher, model_tensors(version), version)
            staged = stage.stage(dataclasses.replace(message, broadcast=BroadcastPlace("127.0.0.1:9", backend)))
            assert staged.version == version and stage.member is None
            stage.end_load(staged, ok=True)
        assert stage.paths_used["shm"] == 2
    finally:
        stage.close()
        publisher.close()
