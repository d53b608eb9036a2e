"""The weight-sync service end to end across processes: the learner's publisher (ring + catch-up + chain-relay
broadcast group) and a generator process's stage. A generator on "another host" (no access to the learner's ring)
catches up first, joins the group, then receives the next version by broadcast; killed with -9, it never holds up
the learner's next publish, and its restart gets the current version."""
import dataclasses
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from asyncrl.weightsync.announcement import ShmRingPlace
from asyncrl.weightsync.backends import make_publisher
from asyncrl.weightsync.config import WeightSyncConfig

pytestmark = pytest.mark.slow


def tensors(version: int) -> list:
    torch.manual_seed(version)
    return [("embed.weight", torch.randn(256, 64)), ("layers.0.w", torch.randn(64, 64)),
            ("layers.0.b", torch.randn(64)), ("lm_head.weight", torch.randn(256, 64))]


def specs(named) -> list:
    return [(name, "float32", tuple(t.shape)) for name, t in named]


def generator(directory: str, inbox, outbox) -> None:
    """A generator's weight path: stage every announced version as a remote host would (no learner ring)."""
    from asyncrl.weightsync.receiver import WeightStage

    stage = WeightStage(directory, "gen-a", catchup_timeout_s=10)
    try:
        while (message := inbox.get()) is not None:
            message = dataclasses.replace(message, shm=ShmRingPlace(os.path.join(directory, "elsewhere"), "other", 2))
            staged = stage.stage(message)
            got = {name: tensor.clone() for name, tensor in staged.buckets.tensors()}
            stage.end_load(staged, ok=True)
            outbox.put((message.version, dict(stage.paths_used), got))
    finally:
        stage.close()


def test_catch_up_then_broadcast_then_a_kill_9_never_blocks_the_learner(tmp_path):
    ws = WeightSyncConfig(backend="broadcast", shm_dir=str(tmp_path), keep_versions=3, bucket_mb=0.05, timeout_s=5)
    publisher = make_publisher(ws, "svc")
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=generator, args=(str(tmp_path), inbox, outbox))
    proc.start()
    try:
        message = publisher.publish(iter(tensors(1)), 1, specs(tensors(1)))  # nobody in the group yet
        inbox.put(message)
        version, paths, got = outbox.get(timeout=60)
        assert version == 1 and paths["catchup"] == 1  # not on the learner's host: caught up
        assert all(torch.equal(got[name], t) for name, t in tensors(1))
        deadline = time.monotonic() + 30  # the first message named the group: the generator joins it
        while not publisher.plane.sender.store.check(["ws/member/1"]):  # its registration (broadcast/protocol.py)
            assert time.monotonic() < deadline, "the generator never registered with the weight group"
            time.sleep(0.01)
        message = publisher.publish(iter(tensors(2)), 2, specs(tensors(2)))
        assert publisher.plane.last_report.delivered, publisher.plane.last_report
        inbox.put(message)
        version, paths, got = outbox.get(timeout=60)
        assert version == 2 and paths["broadcast"] == 1, paths  # delivered by the broadcast group
        assert all(torch.equal(got[name], t) for name, t in tensors(2))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        started = time.monotonic()
        message = publisher.publish(iter(tensors(3)), 3, specs(tensors(3)))
        assert time.monotonic() - started < ws.timeout_s + 3  # a dead member costs at most the timeout
        assert message.version == 3 and len(message.checksums) == len(message.bucket_sizes)
        inbox, outbox = ctx.Queue(), ctx.Queue()  # the killed reader may have died holding the old queue's lock
        restarted = ctx.Process(target=generator, args=(str(tmp_path), inbox, outbox))
        restarted.start()
        inbox.put(message)
        version, paths, got = outbox.get(timeout=60)
        assert version == 3 and all(torch.equal(got[name], t) for name, t in tensors(3))
        inbox.put(None)
        restarted.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        publisher.close()
