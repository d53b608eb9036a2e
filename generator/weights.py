"""Following the learner's weights, on the generator's side: what the announcements in its replies mean, and
bringing the engine to the version they name.

Every reply of the learner carries its newest weights announcement (weightsync/announcement.py). `WeightFollower`:
- hears them (`hear`): keeps the newest, and the last KEPT_WEIGHT_MESSAGES of them for evaluation rounds pinned to a
  version; a message of another learner life (the learner restarted from a checkpoint: its versions repeat or go
  back, with other bytes) replaces everything the previous life announced, whose late messages are then ignored;
- loads (`ensure_latest`, before each group is sampled): stages the target version whole and checksummed
  (weightsync/receiver.py WeightStage) and hands it to the engine, one load at a time; a failed load is counted and
  sampling goes on on the last good version, unless the engine is broken, and the same version is not tried again
  for RETRY_FAILED_S unless a newer one is announced;
- pins (`pinned`): while evaluation prompts of a version are sampled, that version is the target, and rounds of
  later versions wait their turn;
- joins the engine push (weightsync.backend=engine_push) the first time a message names one, if the engine can take
  pushed versions (`PushableEngine`).

Every read of the announcement's fields on the rollout path is in this module.

Pushed versions (the learner's side is weightsync/engine_push/sender.py): the learner drives the engine's update
round through its store (init, start, update, finish); `PushedWeights.handle` runs each call on the generator's
event loop, under the same lock as the staged loads, so a push and a catch-up never overlap:
- start: refused (after LOCK_WAIT_S) while a staged load runs (the learner skips this engine for the version, which
  then arrives by staging), otherwise pause and open the reload;
- update: the workers receive while the learner broadcasts;
- finish: commit the version (vLLM stamps it on every token after), reset the prefix cache, resume.

Never half-loaded, never stuck paused: a failed update, or a round the learner never finishes (it died, or its
watchdog gave up on us), is followed by a load of a complete version from the staging paths (the newest announced,
which the learner's ring or catch-up server holds) before sampling resumes. An update that does not return by its
deadline means the workers are stuck inside the NCCL receive, which nothing in-process can cancel: the engine is
marked broken, sampling raises EngineBroken, and the generator exits for its supervisor to restart it.
"""
import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import Counter

from asyncrl.generator.engines.base import EngineBroken, PushableEngine, WeightLoadError
from asyncrl.weightsync.announcement import WeightsAnnouncement
from asyncrl.weightsync.receiver import WeightSyncError

log = logging.getLogger(__name__)
KEPT_WEIGHT_MESSAGES = 8
"""Announcements of recent versions kept, so an evaluation round can load the version it is pinned to."""
LOCK_WAIT_S = 2.0
"""How long a push waits for the weights lock before it gives this engine up for the version (PushBusy)."""
RETRY_FAILED_S = 5.0
"""A version whose load failed is not tried again for this long unless a newer one is announced. Every worker of a
generator waits on the one load at a time, and none of them hears the learner while it waits: without the pause, the
next worker in line would try the same version at once (each try of an unreachable catch-up server waits out
weightsync.timeout_s), and the generator would never learn that a newer version, or a new learner life, had come."""


class WeightFollower:
    def __init__(self, engine, stage, generator_id: str, stats):
        """`stage`: the generator's weightsync/receiver.py WeightStage (None: nothing is ever loaded); `stats`: the
        rollout's RolloutStats, which counts loads, failures, pushes and the time spent waiting for weights."""
        self.engine, self.stage, self.generator_id, self.stats = engine, stage, generator_id, stats
        self.latest: WeightsAnnouncement | None = None  # the newest of the current learner life (None: none yet)
        self.by_version: dict = {}  # version -> the last few announcements heard of, for evaluation rounds
        self.pins: Counter = Counter()  # version -> evaluation prompts being sampled at it
        self.push_member = None  # weightsync/engine_push member, once an announcement names a push
        self._publisher: str | None = None  # the learner life whose messages are current (weightsync publisher)
        self._retired: set = set()  # earlier lives: their messages, late in stale replies, are ignored
        self._loaded_publisher: str | None = None  # the life whose weights the engine holds (None: the model's)
        self._lock = asyncio.Lock()  # one load at a time, staged or pushed
        self._unpinned = asyncio.Event()
        self._failed: tuple | None = None  # (publisher, version, monotonic time) of the last load that failed
        self.clock = time.monotonic

    def hear(self, announcement: WeightsAnnouncement | None) -> None:
        """The weights announcement of a reply (None: the learner has published nothing yet); typed and checked
        when the reply was decoded (buffer/interface.py::decode_weights)."""
        if announcement is None:
            return
        version, life = announcement.version, announcement.publisher
        if life in self._retired:  # a dead learner's announcement, late: ignored
            return
        if life != self._publisher:
            # a learner that restarted from a checkpoint: its versions repeat or go back, with other bytes, and
            # replace everything the previous life announced
            if self._publisher is not None:
                self._retired.add(self._publisher)
                log.info("generator %s: the learner restarted (publisher %s); following its v%d", self.generator_id,
                         life, version)
            self._publisher = life
            self.latest = announcement
            self.by_version = {version: announcement}
        elif version > (self.latest.version if self.latest is not None else -1):
            self.latest = announcement
            self.by_version[version] = announcement
            for old in sorted(self.by_version)[:-KEPT_WEIGHT_MESSAGES]:
                del self.by_version[old]

    async def ensure_latest(self) -> None:
        """Load the newest announced version if the engine is behind (while evaluation prompts are pinned to a
        version, that one instead); one load at a time."""
        async with self._lock:
            target = self.latest if not self.pins else self.by_version.get(min(self.pins))
            if target is None:
                return
            if self.push_member is None and target.engines and self.stage is not None:
                self.push_member, self.stats.pushes = await join_push(
                    target, self.engine, self._lock, lambda: self.latest, self.stage, self.generator_id,
                    self.stage.catchup_timeout_s)
            foreign = (self._loaded_publisher is not None
                       and target.publisher != self._loaded_publisher)  # an earlier learner life's weights
            if target.version <= self.engine.version and not foreign:
                return
            if self._failed is not None and self._failed[:2] == (target.publisher, target.version) \
                    and self.clock() - self._failed[2] < RETRY_FAILED_S:
                return  # sample on the last good version: the next reply may announce a newer one
            started = time.monotonic()
            try:
                with self.stats.busy:
                    await self._load(target)
            finally:
                self.stats.weight_wait_s += time.monotonic() - started

    async def _load(self, target: WeightsAnnouncement) -> None:
        """Stage `target` and load it; a failed load is counted and logged, and sampling goes on on the last good
        version, unless the engine is broken (EngineBroken is raised: nothing good is left to sample from)."""
        staged = None
        try:
            staged = await asyncio.to_thread(self.stage.stage, target)  # whole and checksummed, or an error
            await self.engine.load_weights(staged, self.stage.good)
            self.stage.end_load(staged, ok=True)
            self._loaded_publisher = target.publisher
            self.stats.weight_loads += 1
            self._failed = None
        except (WeightSyncError, WeightLoadError) as err:
            if staged is not None:
                self.stage.end_load(staged, ok=False)
            self.stats.weight_failures += 1
            self._failed = (target.publisher, target.version, self.clock())
            if isinstance(err, EngineBroken):
                raise
            log.error("generator %s: %s; continuing on v%d", self.generator_id, err, self.engine.version)

    @contextlib.asynccontextmanager
    async def pinned(self, version: int):
        """Hold the engine at `version` (buffer/eval_rounds.py: an evaluation round samples with exactly its
        version's weights), training groups included, until the block ends; pins of later versions wait their
        turn. Yields whether the engine holds `version`: False when it is already past it."""
        self.pins[version] += 1
        try:
            while min(self.pins) != version:
                self._unpinned.clear()
                await self._unpinned.wait()
            await self.ensure_latest()
            yield self.engine.version == version
        finally:
            self.pins[version] -= 1
            if not self.pins[version]:
                del self.pins[version]
            self._unpinned.set()

    def close(self) -> None:
        """Leave the engine push, if this generator joined one."""
        if self.push_member is not None:
            self.push_member.close()


class PushBusy(RuntimeError):
    """The engine is loading a staged version; the learner skips it for this push."""


class PushedWeights:
    def __init__(self, engine, lock: asyncio.Lock, recover_target, stage, loop: asyncio.AbstractEventLoop,
                 generator_id: str):
        """`recover_target()` -> the newest WeightsAnnouncement (None if none); `stage` is the generator's
        weightsync/receiver.py WeightStage, which brings it in whole after a failed push."""
        self.engine, self.lock, self.loop = engine, lock, loop
        self.recover_target, self.stage, self.generator_id = recover_target, stage, generator_id
        self.pushing: int | None = None  # the version between start and finish
        self._expiry: asyncio.TimerHandle | None = None
        self._holding = False  # this round holds the weights lock
        self.counts = {"pushed": 0, "failed": 0, "busy": 0}

    def handle(self, op: str, args: dict, timeout_s: float) -> None:
        """Called in the push member's thread; blocks until the call is done on the event loop, or its deadline."""
        future = asyncio.run_coroutine_threadsafe(self._run(op, args, timeout_s), self.loop)
        try:
            future.result(timeout=max(timeout_s, 0.001))
        except concurrent.futures.TimeoutError:
            future.cancel()
            if op in ("init", "update"):  # the workers are inside an NCCL call nothing here can cancel
                reason = (f"generator {self.generator_id}: the pushed-weights {op} did not return within "
                          f"{timeout_s:.1f} s (the learner died or gave up mid-transfer); the engine's workers are "
                          f"stuck in NCCL and the engine cannot serve")
                self.loop.call_soon_threadsafe(self.engine.mark_broken, reason)
                raise TimeoutError(reason) from None
            raise TimeoutError(f"generator {self.generator_id}: {op} took longer than {timeout_s:.1f} s") from None

    async def _run(self, op: str, args: dict, timeout_s: float) -> None:
        if op == "init":
            await self.engine.push_init(args["init_info"], args.get("transport", "nccl"))
        elif op == "start":
            await self._start(int(args["version"]), timeout_s)
        elif op == "update":
            self._check_pushing(op)
            try:
                await self.engine.push_receive(args["update_info"], args.get("transport", "nccl"))
            except Exception as err:
                await self._recover(f"update failed: {err}")
                raise
        elif op == "finish":
            self._check_pushing(op)
            try:
                await self.engine.push_commit(int(args["version"]))
                self.counts["pushed"] += 1
            except EngineBroken:  # the engine gave up already (a resume failed): nothing to recover into
                self._end()
                raise
            except Exception as err:
                await self._recover(f"finish failed: {err}")
                raise
            self._end()
        # "shutdown": nothing to do here; the next init replaces the group

    async def _start(self, version: int, timeout_s: float) -> None:
        try:  # held briefly by every sampler's version check; for long only by a staged load
            await asyncio.wait_for(self.lock.acquire(), LOCK_WAIT_S)
        except asyncio.TimeoutError:
            self.counts["busy"] += 1
            raise PushBusy(f"generator {self.generator_id} is loading a staged version; v{version} comes by "
                           f"staging") from None
        self._holding = True
        self.pushing = version
        try:
            await self.engine.push_begin()
        except BaseException:
            self._end()
            raise
        # a round the learner never finishes (it died, or aborted us) must not leave the engine paused
        self._expiry = self.loop.call_later(timeout_s, lambda: asyncio.ensure_future(
            self._recover(f"the learner did not finish the push of v{version} within {timeout_s:.1f} s")))

    def _check_pushing(self, op: str) -> None:
        if self.pushing is None:
            raise RuntimeError(f"{op} without a started push (it expired, or start failed)")

    async def _recover(self, cause: str) -> None:
        """Load a complete version from staging, then resume; the lock is released either way."""
        if self.pushing is None:
            return
        version, self.pushing = self.pushing, None
        self.counts["failed"] += 1
        log.error("generator %s: push of v%d failed (%s); loading a complete version from staging", self.generator_id,
                  version, cause)
        staged = None
        try:
            target = self.recover_target()
            staged = (await asyncio.to_thread(self.stage.stage, target) if target is not None and target.version > 0
                      else None)
            await self.engine.push_recover(staged)
            if staged is not None:
                self.stage.end_load(staged, ok=True)
        except EngineBroken:
            if staged is not None:
                self.stage.end_load(staged, ok=False)
            raise
        except Exception as err:  # staging failed: nothing complete to load
            self.engine.mark_broken(f"generator {self.generator_id}: after a failed push of v{version}, no complete "
                               f"version could be staged ({err}); the engine cannot serve")
            raise EngineBroken(self.engine.broken) from err
        finally:
            self._end()

    def _end(self) -> None:
        self.pushing = None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._holding:
            self._holding = False
            self.lock.release()


async def join_push(target: WeightsAnnouncement, engine, lock: asyncio.Lock, recover_target, stage,
                    generator_id: str, timeout_s: float):
    """Register this generator's engine for the push the announcement `target` names (`engines`); returns
    (the member, close it when done; the PushedWeights, whose counts say what came), or (None, None) if the
    message names none or the engine cannot take pushes (it is no PushableEngine: the hf engine)."""
    engines = target.engines
    if not engines or not isinstance(engine, PushableEngine):
        return None, None
    from asyncrl.weightsync.engine_push.member import EnginePushMember

    pushed = PushedWeights(engine, lock, recover_target, stage, asyncio.get_running_loop(), generator_id)
    member = await asyncio.to_thread(EnginePushMember.connect, engines, generator_id, engine.push_ranks,
                                     pushed.handle, timeout_s, engine.push_kind)
    log.info("generator %s: its engine takes versions pushed from the learner at %s", generator_id, engines)
    return member, pushed
