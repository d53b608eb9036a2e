"""The engine push's learner side (weightsync/engine_push/sender.py) and its store control plane (calls.py,
member.py) with a real TCPStore and members that answer every call, in threads of this process.

NCCL needs a GPU (one per rank), so the trainer side is `WireTrainer`: the control flow of vLLM's
`NCCLTrainerWeightTransferEngine` step for step (trainer_init runs the engine's init on a side thread while it opens
its endpoint; send_weights runs start, then update on a thread while it broadcasts, then finish), with the NCCL
broadcast replaced by an in-process wire that the members' fake engines read from. The real thing is
tests/gpu/test_engine_push_real.py."""
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.engine_push.sender import EnginePushSender
from asyncrl.weightsync.engine_push.member import EnginePushMember
from asyncrl.weightsync.layout import plan_layout

SPECS = [("embed.weight", "float32", (64, 16)), ("layers.0.w", "bfloat16", (16, 16)), ("head.bias", "float32", (7,))]


class Wire:
    """The stand-in for NCCL: one queue per group (keyed by the port the trainer opened)."""

    def __init__(self):
        self.channels: dict[int, queue.Queue] = {}
        self.lock = threading.Lock()

    def open(self, port: int) -> queue.Queue:
        with self.lock:
            return self.channels.setdefault(port, queue.Queue())


def wire_round(client, channel, update_info: dict, tensors: list) -> None:
    """One round as vLLM's trainer engines run it: start, the engine's update on a side thread while the tensors
    go out (here: onto the wire), then finish."""
    client.start_weight_update()
    exe = ThreadPoolExecutor(max_workers=1)
    try:
        future = exe.submit(client.update_weights, update_info)
        for tensor in tensors:
            channel.put(tensor.clone())
        future.result()
    finally:
        exe.shutdown(wait=False)
    client.finish_weight_update()


class WireTrainer:
    def __init__(self, wire: Wire, master_address, master_port, world_size, client, source):
        self.client, self.source, self.shut = client, source, False
        self.world_size = world_size
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, {
                "master_address": master_address, "master_port": master_port, "rank_offset": 1,
                "world_size": world_size, "packed": True})
            self.channel = wire.open(master_port)
            future.result()

    def send_weights(self):
        meta = self.source.metadata()
        update_info = {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                       "shapes": [list(m.shape) for m in meta]}
        wire_round(self.client, self.channel, update_info, [tensor for _, tensor in self.source])

    def shutdown(self):
        self.shut = True


class SparseWireTrainer:
    """vLLM's SparseNCCLTrainerWeightTransferEngine's control flow (init as the dense one; send_weights(patches):
    nothing for no patches, else start, update on a thread while indices then values of each patch are broadcast,
    finish), over the same wire. Patches are delta.sparse_patches tuples (the host's `to_patches` is identity)."""

    def __init__(self, wire: Wire, master_address, master_port, world_size, client, source):
        self.client, self.shut, self.sent = client, False, []
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, {
                "master_address": master_address, "master_port": master_port, "rank_offset": 1,
                "world_size": world_size})
            self.channel = wire.open(master_port)
            future.result()

    def send_weights(self, patches=None):
        patches = list(patches or [])
        if not patches:
            return
        self.sent.append([name for name, *_ in patches])
        update_info = {"names": [p[0] for p in patches], "dtype_names": [str(p[2].dtype).split(".")[-1]
                                                                         for p in patches],
                       "shapes": [list(p[3]) for p in patches], "num_updates_list": [p[1].numel() for p in patches]}
        wire_round(self.client, self.channel, update_info, [t for _, indices, values, _ in patches
                                                            for t in (indices, values)])

    def shutdown(self):
        self.shut = True


class FakeEngine:
    """A generator's engine as the member's handler sees it: records each call; `hang_update` never returns from
    an update (workers stuck in the receive), `fail` makes one op raise."""

    def __init__(self, wire: Wire, hang_update: bool = False, fail: str = ""):
        self.wire, self.hang_update, self.fail = wire, hang_update, fail
        self.calls: list[tuple] = []
        self.channels: dict = {}  # transport -> its wire
        self.received: dict = {}
        self.version = 0
        self.never = threading.Event()

    def handle(self, op: str, args: dict, timeout_s: float) -> None:
        self.calls.append((op, args))
        if op == self.fail:
            raise RuntimeError(f"{op} refused by the test")
        if op == "init":
            self.channels[args["transport"]] = self.wire.open(args["init_info"]["master_port"])
        elif op == "update":
            if self.hang_update:
                self.never.wait(timeout_s)
                raise TimeoutError("stuck")
            info, channel = args["update_info"], self.channels[args["transport"]]
            if args["transport"] == "sparse_nccl":  # patches applied in place, as vLLM's sparse engine does
                for name in info["names"]:
                    indices, values = channel.get(timeout=timeout_s), channel.get(timeout=timeout_s)
                    self.received[name].view(-1)[indices.long()] = values
            else:
                self.received = {name: channel.get(timeout=timeout_s) for name in info["names"]}
        elif op == "finish":
            self.version = args["version"]


def version_buckets(seed: int) -> FlatBuckets:
    layout = plan_layout(SPECS, 1024)
    buckets = FlatBuckets(layout)
    generator = torch.Generator().manual_seed(seed)
    for name, dtype, shape in SPECS:
        buckets.put(name, torch.randn(shape, generator=generator).to(getattr(torch, dtype)))
    return buckets


@pytest.fixture
def push():
    wire = Wire()
    trainers = []

    def factory(kind, transport, *args):
        assert kind == "vllm" and transport == "nccl"
        trainer = WireTrainer(wire, *args)
        trainers.append(trainer)
        return trainer

    host = EnginePushSender(heartbeat_timeout_s=1.0, trainer_factory=factory)
    members = []

    def join(member_id: str, engine: FakeEngine, ranks: int = 1) -> EnginePushMember:
        member = EnginePushMember.connect(host.address, member_id, ranks, engine.handle, timeout_s=10)
        members.append(member)
        return member

    yield host, wire, trainers, join
    for member in members:
        member.close()
    host.close()


def test_every_engine_gets_each_version_in_full_over_its_own_group(push):
    host, wire, trainers, join = push
    engines = {name: FakeEngine(wire) for name in ("gen-a", "gen-b")}
    join("gen-a", engines["gen-a"], ranks=2)
    join("gen-b", engines["gen-b"])
    for version in (1, 2):
        buckets = version_buckets(version)
        report = host.send(version, buckets, timeout_s=20)
        assert report.ok and sorted(report.delivered) == ["gen-a", "gen-b"], report
        for engine in engines.values():
            assert engine.version == version
            for entry in buckets.layout.entries:
                assert torch.equal(engine.received[entry.name], buckets.view(entry)), entry.name
    for engine in engines.values():  # one init per engine, then start/update/finish per version
        assert [op for op, _ in engine.calls] == ["init", "start", "update", "finish", "start", "update", "finish"]
    inits = {name: engine.calls[0][1]["init_info"] for name, engine in engines.items()}
    assert inits["gen-a"]["world_size"] == 3 and inits["gen-b"]["world_size"] == 2  # the learner + its ranks
    assert inits["gen-a"]["master_port"] != inits["gen-b"]["master_port"]  # a group each
    assert engines["gen-a"].calls[2][1]["update_info"]["dtype_names"] == ["float32", "bfloat16", "float32"]


def test_a_stuck_engine_is_named_aborted_and_never_holds_back_the_others(push):
    host, wire, trainers, join = push
    good, stuck = FakeEngine(wire), FakeEngine(wire, hang_update=True)
    join("good", good)
    join("stuck", stuck)
    started = time.monotonic()
    report = host.send(1, version_buckets(1), timeout_s=2.0)
    took = time.monotonic() - started
    assert took < 4.0, f"the send took {took:.1f} s with a 2 s timeout"
    assert report.delivered == ["good"] and good.version == 1
    assert "stuck" in report.failed and "'stuck'" in report.failed["stuck"], report.failed
    stuck_trainer = next(t for t in trainers if t.client.who.startswith("member 'stuck'"))
    assert stuck_trainer.shut  # its communicator was aborted (vLLM's shutdown)
    stuck.hang_update = False
    report = host.send(2, version_buckets(2), timeout_s=10)
    assert sorted(report.delivered) == ["good", "stuck"], report
    assert [op for op, _ in stuck.calls].count("init") == 2  # a new group after the abort
    assert stuck.version == 2


def test_a_refused_call_fails_that_engine_only_naming_it_and_why(push):
    host, wire, trainers, join = push
    join("ok", FakeEngine(wire))
    join("refuses", FakeEngine(wire, fail="start"))
    report = host.send(1, version_buckets(1), timeout_s=10)
    assert report.delivered == ["ok"]
    assert "start refused by the test" in report.failed["refuses"] and "'refuses'" in report.failed["refuses"]


def test_a_dead_engine_is_dropped_after_its_heartbeat_stops_and_a_restart_rejoins(push):
    host, wire, trainers, join = push
    join("alive", FakeEngine(wire))
    dead = join("dead", FakeEngine(wire))
    assert sorted(host.send(1, version_buckets(1), timeout_s=10).delivered) == ["alive", "dead"]
    dead._stop.set()  # kill -9 as the store sees it: no heartbeat, no answers, no "left"
    time.sleep(1.5)
    report = host.send(2, version_buckets(2), timeout_s=3)
    assert report.delivered == ["alive"] and report.dropped == ["dead"], report
    restarted = FakeEngine(wire)
    join("dead", restarted)
    report = host.send(3, version_buckets(3), timeout_s=10)
    assert sorted(report.delivered) == ["alive", "dead"] and restarted.version == 3


def test_the_publisher_pushes_each_complete_version_and_names_the_push_in_its_message(push, tmp_path):
    from asyncrl.weightsync.backends import EnginePushPlane
    from asyncrl.weightsync.publisher import WeightPublisher

    host, wire, trainers, join = push
    engine = FakeEngine(wire)
    join("gen-a", engine)
    pusher = EnginePushPlane(host, timeout_s=10, device="cpu")  # on a GPU: the learner's device
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=3, bucket_bytes=1024, plane=pusher)
    try:
        source = version_buckets(7)
        message = publisher.publish(((e.name, source.view(e)) for e in source.layout.entries), 7, SPECS)
        assert message.engines == host.address and message.broadcast is None
        assert pusher.last_report.delivered == ["gen-a"] and engine.version == 7
        for entry in source.layout.entries:
            assert torch.equal(engine.received[entry.name], source.view(entry))
    finally:
        publisher.ring.close(unlink=True)


def test_engine_push_is_refused_where_it_cannot_work(tmp_path):
    from asyncrl.configs import load_config
    from asyncrl.weightsync.backends import make_publisher
    from asyncrl.weightsync.config import WeightSyncConfig

    with pytest.raises(Exception, match="engine_push pushes into vLLM.s or SGLang"):
        load_config(None, ["weightsync.backend=engine_push", "generator.engine=hf"])
    with pytest.raises(Exception, match="engine_transport=ipc is vLLM's IPC"):
        load_config(None, ["weightsync.backend=engine_push", "weightsync.engine_transport=ipc",
                           "generator.engine=sglang"])
    with pytest.raises(Exception, match="engine_transport must be one of"):
        load_config(None, ["weightsync.engine_transport=pigeon"])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            make_publisher(WeightSyncConfig(backend="engine_push", shm_dir=str(tmp_path)), "t")


def test_sparse_nccl_sends_only_what_changed_to_engines_that_hold_the_previous_version(tmp_path):
    wire, sparse_trainers = Wire(), []

    def factory(kind, transport, *args):
        if transport == "sparse_nccl":
            sparse_trainers.append(SparseWireTrainer(wire, *args))
            return sparse_trainers[-1]
        return WireTrainer(wire, *args)

    host = EnginePushSender(heartbeat_timeout_s=5.0, trainer_factory=factory, transport="sparse_nccl",
                          to_patches=lambda patches: patches)
    steady, flaky = FakeEngine(wire), FakeEngine(wire)
    members = [EnginePushMember.connect(host.address, name, 1, engine.handle, timeout_s=10)
               for name, engine in (("steady", steady), ("flaky", flaky))]
    try:
        versions = {1: version_buckets(1)}
        assert sorted(host.send(1, versions[1], timeout_s=20).delivered) == ["flaky", "steady"]  # dense: no base
        for version in (2, 3):
            versions[version] = version_buckets(1)
            with torch.no_grad():
                for k, entry in enumerate(versions[version].layout.entries):
                    versions[version].view(entry).view(-1)[version + k] += 1  # one element of each tensor moves
        flaky.fail = "update"  # flaky misses v2: its base is gone, so v3 reaches it dense
        report = host.send(2, versions[2], timeout_s=20)
        assert report.delivered == ["steady"] and "flaky" in report.failed
        flaky.fail = ""
        report = host.send(3, versions[3], timeout_s=20)
        assert sorted(report.delivered) == ["flaky", "steady"], report
        sparse_updates = [args["update_info"] for op, args in steady.calls
                          if op == "update" and args["transport"] == "sparse_nccl"]
        # v1 -> v2 moved one element per tensor; v2 -> v3 moved that one back and another
        assert [u["num_updates_list"] for u in sparse_updates] == [[1, 1, 1], [2, 2, 2]]
        # v1 dense, v2 sparse (refused), v3 dense again: after the failure its base was unknown
        assert [args["transport"] for op, args in flaky.calls if op == "update"] == ["nccl", "sparse_nccl", "nccl"]
        for engine in (steady, flaky):
            assert engine.version == 3
            for entry in versions[3].layout.entries:
                assert torch.equal(engine.received[entry.name], versions[3].view(entry)), entry.name
        report = host.send(4, versions[3], timeout_s=20)  # nothing changed: an empty round commits v4
        assert sorted(report.delivered) == ["flaky", "steady"] and steady.version == 4
        assert [op for op, _ in steady.calls[-2:]] == ["start", "finish"]
    finally:
        for member in members:
            member.close()
        host.close()
