"""generator/weights.py: the generator's side of a pushed version, with a fake engine (the push_* calls of
VllmEngine, recorded) on an event loop of its own, driven from another thread as the push member drives it."""
import asyncio
import threading
import time

import pytest

from asyncrl.generator import weights
from asyncrl.generator.engines.base import EngineBroken
from asyncrl.generator.weights import PushBusy, PushedWeights
from asyncrl.weightsync.receiver import WeightSyncError
from tests.messages import announcement


class FakeEngine:
    def __init__(self, fail: str = "", hang: str = ""):
        self.fail, self.hang = fail, hang
        self.calls: list = []
        self.version = 0
        self.broken = None
        self.paused = False

    async def _op(self, name, *args):
        self.calls.append((name, *args))
        if name == self.hang:
            await asyncio.sleep(3600)
        if name == self.fail:
            raise RuntimeError(f"{name} failed in the test")

    async def push_init(self, info, transport="nccl"):
        await self._op("init", info)

    async def push_begin(self):
        self.paused = True
        await self._op("begin")

    async def push_receive(self, info, transport="nccl"):
        await self._op("receive", info)

    async def push_commit(self, version):
        await self._op("commit", version)
        self.version, self.paused = version, False

    async def push_recover(self, staged):
        self.calls.append(("recover", staged.version if staged else None))
        if staged is not None:
            self.version = staged.version
        self.paused = False

    def mark_broken(self, reason):
        self.broken = reason


class FakeStage:
    def __init__(self):
        self.staged, self.ended = [], []

    def stage(self, message):
        self.staged.append(message.version)
        return type("Staged", (), {"version": message.version})()

    def end_load(self, staged, ok):
        self.ended.append((staged.version, ok))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def make(loop, engine, latest=None):
    lock = asyncio.run_coroutine_threadsafe(_new_lock(), loop).result()
    stage = FakeStage()
    return PushedWeights(engine, lock, lambda: latest, stage, loop, "gen-t"), lock, stage


async def _new_lock():
    return asyncio.Lock()


def test_a_push_pauses_receives_commits_and_releases_the_lock(loop):
    engine = FakeEngine()
    pushed, lock, _ = make(loop, engine)
    pushed.handle("init", {"init_info": {"master_port": 1}}, 5)
    pushed.handle("start", {"version": 3}, 5)
    assert lock.locked() and engine.paused
    pushed.handle("update", {"update_info": {"names": ["w"]}}, 5)
    pushed.handle("finish", {"version": 3}, 5)
    assert engine.version == 3 and not engine.paused and not lock.locked()
    assert [c[0] for c in engine.calls] == ["init", "begin", "receive", "commit"]
    assert pushed.counts == {"pushed": 1, "failed": 0, "busy": 0}


def test_a_failed_update_loads_the_newest_announced_version_whole_before_resuming(loop):
    engine = FakeEngine(fail="receive")
    pushed, lock, stage = make(loop, engine, latest=announcement(2))
    pushed.handle("start", {"version": 3}, 5)
    with pytest.raises(RuntimeError, match="receive failed"):
        pushed.handle("update", {"update_info": {}}, 5)
    assert stage.staged == [2] and stage.ended == [(2, True)]
    assert engine.calls[-1] == ("recover", 2) and engine.version == 2 and not engine.paused
    assert not lock.locked() and pushed.counts["failed"] == 1
    with pytest.raises(RuntimeError, match="without a started push"):  # a late finish for it commits nothing
        pushed.handle("finish", {"version": 3}, 5)
    assert engine.version == 2


def test_a_round_the_learner_never_finishes_expires_into_a_reload(loop):
    engine = FakeEngine()
    pushed, lock, _ = make(loop, engine, latest=None)
    pushed.handle("start", {"version": 1}, 0.3)
    pushed.handle("update", {"update_info": {}}, 5)
    deadline = time.monotonic() + 5
    while lock.locked() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not lock.locked() and engine.calls[-1] == ("recover", None) and not engine.paused


def test_a_push_during_a_staged_load_is_refused_not_queued(loop, monkeypatch):
    monkeypatch.setattr(weights, "LOCK_WAIT_S", 0.2)
    engine = FakeEngine()
    pushed, lock, _ = make(loop, engine)
    asyncio.run_coroutine_threadsafe(lock.acquire(), loop).result()  # a staged load holds it
    with pytest.raises(PushBusy, match="staging"):
        pushed.handle("start", {"version": 4}, 5)
    assert pushed.counts["busy"] == 1 and engine.calls == []


def test_an_update_stuck_past_its_deadline_breaks_the_engine(loop):
    engine = FakeEngine(hang="receive")
    pushed, _, _ = make(loop, engine)
    pushed.handle("start", {"version": 1}, 5)
    with pytest.raises(TimeoutError, match="stuck in NCCL"):
        pushed.handle("update", {"update_info": {}}, 0.3)
    deadline = time.monotonic() + 2
    while engine.broken is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.broken and "gen-t" in engine.broken


def test_a_failed_recovery_breaks_the_engine(loop):
    engine = FakeEngine(fail="receive")
    pushed, _, stage = make(loop, engine, latest=announcement(5))
    stage.stage = lambda message: (_ for _ in ()).throw(OSError("ring gone"))
    pushed.handle("start", {"version": 6}, 5)
    with pytest.raises((EngineBroken, RuntimeError)):
        pushed.handle("update", {"update_info": {}}, 5)
    assert engine.broken and "ring gone" in engine.broken


def test_a_broken_commit_is_not_recovered_into_and_never_releases_a_lock_it_does_not_hold(loop):
    engine = FakeEngine()

    async def broken_commit(version):
        raise EngineBroken("resume failed")

    engine.push_commit = broken_commit
    pushed, lock, stage = make(loop, engine, latest=announcement(1))
    pushed.handle("start", {"version": 2}, 5)
    pushed.handle("update", {"update_info": {}}, 5)
    with pytest.raises(EngineBroken):
        pushed.handle("finish", {"version": 2}, 5)
    assert not lock.locked() and stage.staged == [] and ("recover", 1) not in engine.calls
    asyncio.run_coroutine_threadsafe(lock.acquire(), loop).result()  # a staged load takes it now
    asyncio.run_coroutine_threadsafe(pushed._recover("late expiry"), loop).result()  # a stray recovery
    assert lock.locked()  # still the staged load's


def test_the_generators_stats_report_its_pushes():
    from types import SimpleNamespace

    from asyncrl.generator.rollout import RolloutStats

    stats = RolloutStats()
    assert not any(key.startswith("generator/weight_pushes/") for key in stats.snapshot(0))
    stats.pushes = SimpleNamespace(counts={"pushed": 4, "failed": 1, "busy": 2})
    snapshot = stats.snapshot(5)
    assert (snapshot["generator/weight_pushes/pushed"], snapshot["generator/weight_pushes/failed"],
            snapshot["generator/weight_pushes/busy"]) == (4.0, 1.0, 2.0)


class UnreachableStage(FakeStage):
    """Every version fails to stage, as when the catch-up server cannot be reached and the ring has moved on."""

    catchup_timeout_s = 0.01

    def stage(self, message):
        self.staged.append((message.publisher, message.version))
        raise WeightSyncError(f"weights v{message.version}: no complete copy could be staged (in the test)")


def test_a_version_that_failed_to_load_is_not_tried_again_at_once_but_a_newer_one_is():
    """The soak's generator behind the ring: a load that fails is not repeated by the next worker in line (each try
    of an unreachable catch-up server waits out its timeout, and no worker hears the learner meanwhile); the worker
    samples on the last good version, and the next announcement, newer or of a new learner life, is tried at once;
    the same version again only after RETRY_FAILED_S."""
    from asyncrl.generator.rollout import RolloutStats
    from asyncrl.generator.weights import RETRY_FAILED_S, WeightFollower

    now = [100.0]
    stage = UnreachableStage()
    follower = WeightFollower(FakeEngine(), stage, "gen-t", RolloutStats())
    follower.clock = lambda: now[0]

    async def workers(count):
        await asyncio.gather(*(follower.ensure_latest() for _ in range(count)))

    async def scenario():
        follower.hear(announcement(470, publisher="life-1"))
        await workers(3)
        assert stage.staged == [("life-1", 470)] and follower.stats.weight_failures == 1
        follower.hear(announcement(471, publisher="life-1"))
        await workers(2)
        assert stage.staged[1:] == [("life-1", 471)]
        follower.hear(announcement(5, publisher="life-2"))  # the learner restarted from a checkpoint
        await workers(2)
        assert stage.staged[2:] == [("life-2", 5)]
        now[0] += RETRY_FAILED_S
        await workers(2)
        assert stage.staged[3:] == [("life-2", 5)] and follower.engine.version == 0  # tried once more; still v0

    asyncio.run(scenario())
