"""Versions pushed from the learner's GPU straight into this generator's engine, vLLM or SGLang
(weightsync.backend=engine_push; the learner's side is weightsync/engine_push/sender.py).

The learner drives vLLM's update round through the store (init, start, update, finish); `PushedWeights.handle`
runs each call on the generator's event loop, under the same lock as the staged loads of rollout.py, so a push and
a catch-up never overlap:
- start: refused (after LOCK_WAIT_S) while a staged load runs (the learner skips this engine for the version, which then
  arrives by staging), otherwise pause and open the reload;
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
import logging

from asyncrl.generator.engines.base import EngineBroken

log = logging.getLogger(__name__)
LOCK_WAIT_S = 2.0
"""How long a push waits for the weights lock before it gives this engine up for the version (PushBusy)."""


class PushBusy(RuntimeError):
    """The engine is loading a staged version; the learner skips it for this push."""


class PushedWeights:
    def __init__(self, engine, lock: asyncio.Lock, recover_target, stage, loop: asyncio.AbstractEventLoop,
                 generator_id: str):
        """`recover_target()` -> the newest announcement (None if none); `stage` is the generator's
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
            staged = await asyncio.to_thread(self.stage.stage, target) if target is not None and target.version > 0 \
                else None
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


async def join_push(target, engine, lock: asyncio.Lock, recover_target, stage, generator_id: str,
                    timeout_s: float):
    """Register this generator's engine for the push the announcement `target` names (`engines`); returns
    (the member, close it when done; the PushedWeights, whose counts say what came), or (None, None) if the
    message names none or the engine cannot take pushes."""
    engines = target.engines
    if not engines or not hasattr(engine, "push_init"):
        return None, None
    from asyncrl.weightsync.engine_push.member import EnginePushMember

    pushed = PushedWeights(engine, lock, recover_target, stage, asyncio.get_running_loop(), generator_id)
    member = await asyncio.to_thread(EnginePushMember.connect, engines, generator_id, engine.push_ranks,
                                     pushed.handle, timeout_s, engine.push_kind)
    log.info("generator %s: its engine takes versions pushed from the learner at %s", generator_id, engines)
    return member, pushed
