"""The engine push into SGLang, end to end on CPU: the learner's EnginePushSender with SglangTrainer, a generator's
push member and PushedWeights driving the real SglangEngine and its receiver on the faithful fake SGLang
(tests/fakes/fake_sglang.py), over a real TCPStore and a real gloo weight-update group (SGLang joins it with
`init_weights_update_group` and receives with `update_weights_from_distributed`, one broadcast per tensor). Only
NCCL is swapped for gloo; tests/gpu/test_engine_push_real.py runs the real SGLang."""
import asyncio
import threading

import torch

from asyncrl.buffer.group import Sampling
from asyncrl.generator.weights import join_push
from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.dtypes import dtype_name
from asyncrl.weightsync.engine_push.sender import EnginePushSender
from asyncrl.weightsync.engine_push.sglang_trainer import SglangTrainer
from asyncrl.weightsync.layout import plan_layout
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage
from tests.fakes.fake_sglang import join_weights_group
from tests.fakes.sglang_setup import build, weights_without_eos
from tests.messages import announcement


def gloo_rank0(master_address, master_port, world_size, group_name, backend):
    return join_weights_group(master_address, master_port, 0, world_size, group_name, backend)


def sglang_on_gloo(kind, transport, *args):
    assert kind == "sglang"
    return SglangTrainer(*args, open_group=gloo_rank0, backend="gloo")


def specs_of(weights: dict) -> list:
    return [(name, dtype_name(tensor.dtype), tuple(tensor.shape)) for name, tensor in weights.items()]


def as_buckets(weights: dict) -> FlatBuckets:
    buckets = FlatBuckets(plan_layout(specs_of(weights), 1 << 16))
    for name, tensor in weights.items():
        buckets.put(name, tensor)
    return buckets


def test_sglang_takes_pushed_versions_and_goes_back_to_a_complete_one_after_a_failed_push(tmp_path):
    engine, _ = build(tmp_path, timeout_s=20.0)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coroutine, timeout_s=30):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout_s)

    host = EnginePushSender(heartbeat_timeout_s=10.0, trainer_factory=sglang_on_gloo)
    publisher = WeightPublisher(str(tmp_path / "learner.ring"), slots=3, bucket_bytes=1 << 16)
    stage = WeightStage(str(tmp_path), "gen-s")
    latest: list = []  # what the learner announced, newest last (the recovery stages it)
    member = None
    try:
        on_loop(engine.start())
        fake = engine._engine

        async def join():
            return await join_push(announcement(0, engines=host.address), engine, asyncio.Lock(),
                                   lambda: latest[-1] if latest else None, stage, "gen-s", 10.0)

        member, pushed = on_loop(join())
        v1 = weights_without_eos(1)
        report = host.send(1, as_buckets(v1), timeout_s=30)
        assert report.ok and report.delivered == ["gen-s"], report
        assert all(torch.equal(fake.weights[name], tensor) for name, tensor in v1.items())
        assert engine.version == 1 and fake.weight_version() == "1"
        names = [name for name, _ in fake.calls]
        assert names[:4] == ["init_weights_update_group", "pause_generation", "update_weights_from_distributed",
                             "flush_cache"] and "continue_generation" in names
        update = dict(fake.calls)["update_weights_from_distributed"]
        assert update["paused"] and update["weight_version"] == "1" and update["dtypes"] == ["float32"] * 2
        completion, = on_loop(engine.sample([3, 4, 5], Sampling(temperature=1.0, max_tokens=4), n=1))
        assert set(completion.versions) == {1}

        latest.append(publisher.publish(iter(v1.items()), 1, specs_of(v1)))
        bad = {**weights_without_eos(2), "extra.bias": torch.zeros(3)}  # SGLang has no such parameter
        report = host.send(2, as_buckets(bad), timeout_s=30)
        assert report.delivered == [] and "no parameter extra.bias" in report.failed["gen-s"], report
        assert engine.version == 1 and engine.broken is None  # went back to v1, loaded whole from staging
        assert all(torch.equal(fake.weights[name], tensor) for name, tensor in v1.items())
        failed_at = max(i for i, (name, _) in enumerate(fake.calls) if name == "update_weights_from_distributed")
        reload = [args for name, args in fake.calls[failed_at:] if name == "update_weights_from_tensor"]
        assert len(reload) == 1 and reload[0]["weight_version"] == "1" and reload[0]["flush_cache"]
        completion, = on_loop(engine.sample([3, 4, 5], Sampling(temperature=1.0, max_tokens=4), n=1))
        assert set(completion.versions) == {1}

        v3 = weights_without_eos(3)
        report = host.send(3, as_buckets(v3), timeout_s=30)  # a new group after the failure
        assert report.ok, report
        assert [name for name, _ in fake.calls].count("init_weights_update_group") == 2
        assert engine.version == 3 and all(torch.equal(fake.weights[n], t) for n, t in v3.items())
        assert pushed.counts == {"pushed": 2, "failed": 1, "busy": 0}
    finally:
        if member is not None:
            member.close()
        host.close()
        on_loop(engine.close())
        stage.close()
        publisher.close()
        loop.call_soon_threadsafe(loop.stop)
