"""The SGLang side of weight sync: one staged version per load, one pause -> load -> resume per version.

Written against SGLang 0.5.x (pause modes need >= 0.5.6; checked against sgl-project/sglang's
`tokenizer_communicator_mixin.py`, `tokenizer_manager.py`, `entrypoints/engine.py` and
`docs/advanced_features/sglang_for_rl.md`). The engine handle is anything with the async methods of
`sglang_engine.AsyncSglangEngine` (the real engine) or `tests/fakes/fake_sglang.FakeSglangEngine`.

Two ways in, one per situation:
  * a version the generator has staged (weightsync/receiver.py `Staged`: complete, checksummed, in a slot nobody
    writes to), sent with `update_weights_from_tensor`: generators on the learner's host or fed by catch-up;
  * with weightsync.backend=engine_push on GPUs, a version pushed from the learner's GPU: SGLang joins the
    learner's group (`init_weights_update_group`) and receives each version with
    `update_weights_from_distributed` while the learner broadcasts (weightsync/engine_push/sglang_trainer.py),
    wrapped in the same pause and resume (`push_begin`, `push_receive`, `push_commit`); a push that fails
    half-way is followed by a full load from staging (`push_recover`).
`update_weights_from_disk` serves only to go back to the model's own files.

What a version costs, and what it guarantees (docs/architecture.md §6):
  * Admission closes, generation pauses, `update_weights_from_tensor(..., flush_cache=True)` loads every tensor
    and resets the prefix cache, `weight_version` is recorded, generation continues, admission opens. No request
    is sampled while weights are partly written: new requests wait at admission, running ones are paused or gone
    (see update modes).
  * A failed load stays paused, aborts whatever is still queued and goes back to the last good version: the
    `fallback` the generator still has staged (again with `update_weights_from_tensor`), or, with none, the
    model's own files (`update_weights_from_disk`, version 0). A load that stops midway leaves the weights partly
    written and SGLang has nothing to undo it with, so going back is a full load. Then it continues and raises
    `WeightLoadError` naming the version, the cause and what it went back to. If going back fails too, the
    receiver is `broken`: it stays paused and every sample raises `EngineBroken`, so the process can be
    restarted (generators may restart at any time, docs/architecture.md §6 membership).
  * Every wait is bounded by `timeout_s`, and a timeout names the engine and what it was waiting for. Giving up
    does not stop SGLang's scheduler, which may still be loading; the rollback queued behind it then times out
    too, and the receiver is `broken` (restart the generator).

Update modes (asyncrl `generator.update_mode`) on SGLang's pause modes (`abort`, `retract`, `in_place`):
  wait   Drain: stop admitting and let in-flight requests finish (up to `drain_timeout_s`), then
         `pause_generation(mode="abort")`, which only aborts stragglers (returned with finish_reason "abort").
         SGLang has no draining pause, so the drain is ours.
  abort  `pause_generation(mode="abort")`: in-flight requests come back at once, partial, finish_reason "abort".
  keep   Gap: SGLang cannot flush its prefix cache while any request is queued or running (its scheduler
         asserts after an update with flush_cache=True; TorchRL's SGLangWeightSyncScheme documents the same),
         so a pause that keeps requests (`retract`, `in_place`) cannot reset the cache in the same step. We use
         `retract` (running requests leave the batch, so no forward overlaps the weight write; `in_place` needs
         an overlap-scheduler fix in some builds), load with flush_cache=False, continue -- kept requests finish
         on the new weights with their old-weight KV prefix, as in vLLM's keep -- and keep admission closed
         until they drain, then flush, so no new request can hit a stale cached prefix.
"""
import asyncio
import contextlib
import logging

from asyncrl.generator.engines.base import EngineBroken, WeightLoadError
from asyncrl.generator.engines.checkpoint_layout import CheckpointLayout

log = logging.getLogger(__name__)

PAUSE_MODES = {"wait": "abort", "abort": "abort", "keep": "retract"}
"""SGLang pause mode used for each asyncrl update mode (see the module docstring for why)."""


class SglangTimeoutError(TimeoutError):
    """A bounded wait on SGLang ran out; the message says what was awaited and names the engine."""


async def bounded(awaitable, timeout_s: float, what: str, peer: str):
    """Await with a deadline whose error says what was awaited and who did not answer."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise SglangTimeoutError(f"{what}: no answer from {peer} within {timeout_s:g}s") from None


class SglangWeightReceiver:
    def __init__(self, engine, update_mode: str, model_path: str, timeout_s: float, drain_timeout_s: float):
        if update_mode not in PAUSE_MODES:
            raise ValueError(f"sglang update_mode must be one of {tuple(PAUSE_MODES)}, got {update_mode!r}")
        self.engine = engine
        self.update_mode = update_mode
        self.model_path = model_path  # the model's own files: version 0, the rollback target with no fallback
        self.timeout_s = timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.version = 0
        self.broken: str | None = None  # set when even the rollback failed: the engine must be restarted
        self.engine_peer = f"sglang engine ({model_path})"
        self._admit = asyncio.Event()
        self._admit.set()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._lock = asyncio.Lock()  # one load at a time
        self._push_group: str | None = None  # the learner's weight-update group joined for pushes
        self._layout = None  # checkpoint_layout.CheckpointLayout: SGLang loads the files' layout, built at first use

    # --- the sampler's side ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admitted(self):
        """Held by each request: waits while a load is in progress, and counts the request for draining."""
        while not self._admit.is_set():
            await self._admit.wait()
        if self.broken:
            raise EngineBroken(self.broken)
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    # --- the way in: a staged version ---------------------------------------------------------------------

    async def load_staged(self, staged, fallback=None) -> None:
        """pause -> load `staged` -> record its version -> resume. A failed load goes back to `fallback` (the last
        good staged version; None: the model's own files) and raises WeightLoadError; EngineBroken if going back
        or resuming fails too."""
        version = staged.version
        async with self._lock:
            if self.broken:
                raise EngineBroken(f"sglang v{version} not loaded: {self.broken}")
            try:
                await self._pause()
                success, reason, *_ = await self._send(staged, f"load v{version}",
                                                       flush_cache=self.update_mode != "keep")
                if not success:
                    raise RuntimeError(f"SGLang refused v{version} from staging slot {staged.slot}: {reason}")
            except Exception as err:
                await self._roll_back(version, str(err), err, fallback)
            await self._commit(version, "loaded")

    async def _commit(self, version: int, how: str) -> None:
        """The version is in: record it and resume; a failed resume leaves the engine broken."""
        self.version = version
        try:
            await self._resume()
        except Exception as err:
            self.mark_broken(f"v{version} {how} but generation could not resume ({err})")
            raise EngineBroken(f"sglang v{version}: {self.broken}") from err

    def _send(self, staged, what: str, flush_cache: bool):
        """`update_weights_from_tensor` with the staged slot's tensors in the layout of the model's files (MoE
        experts one tensor each, as SGLang's loaders read them), bounded; SGLang answers (success, message)."""
        if self._layout is None:
            self._layout = CheckpointLayout.for_model_dir(self.model_path)
        return bounded(self.engine.update_weights_from_tensor(
            named_tensors=self._layout.convert(staged.buckets.tensors()), flush_cache=flush_cache,
            weight_version=str(staged.version)), self.timeout_s, f"{what} from staging slot {staged.slot}",
            self.engine_peer)

    # --- steps --------------------------------------------------------------------------------------------

    async def _pause(self) -> None:
        """Close admission; for `wait`, let in-flight requests finish first; then pause SGLang."""
        self._admit.clear()
        if self.update_mode == "wait":
            await self._drain()  # whatever is left after the drain timeout is aborted by the pause below
        await bounded(self.engine.pause_generation(mode=PAUSE_MODES[self.update_mode]), self.timeout_s,
                      "pause generation", self.engine_peer)

    async def _resume(self) -> None:
        """Continue; for `keep`, flush the prefix cache once the kept requests are done, then admit."""
        await bounded(self.engine.continue_generation(), self.timeout_s, "continue generation", self.engine_peer)
        if self.update_mode == "keep":
            if not await self._drain():
                await bounded(self.engine.pause_generation(mode="abort"), self.timeout_s,
                              "abort requests that outlived the drain", self.engine_peer)
                await self._flush_when_idle()
                await bounded(self.engine.continue_generation(), self.timeout_s, "continue generation",
                              self.engine_peer)
            else:
                await self._flush_when_idle()
        self._admit.set()

    async def _drain(self) -> bool:
        """Wait for our in-flight requests to finish; False if some are still running after the drain timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
            return True
        except asyncio.TimeoutError:
            log.warning("sglang: %d requests still running after %gs; aborting them", self._inflight,
                        self.drain_timeout_s)
            return False

    async def _flush_when_idle(self) -> None:
        """flush_cache succeeds only once the scheduler has no queued or running request: retry until then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            remaining = deadline - loop.time()
            result = await bounded(self.engine.flush_cache(), max(remaining, 0.001), "flush prefix cache",
                                   self.engine_peer)
            if result.success:
                return
            if loop.time() >= deadline:
                raise SglangTimeoutError(f"flush prefix cache: {self.engine_peer} still busy after "
                                         f"{self.timeout_s:g}s")
            await asyncio.sleep(0.01)

    async def _reload(self, fallback) -> None:
        """Still paused: abort what is queued, load `fallback` (None: the model's files) in full, continue."""
        # Aborting first frees the model-update lock held by queued requests (the reload takes it).
        await bounded(self.engine.pause_generation(mode="abort"), self.timeout_s, "abort before rollback",
                      self.engine_peer)
        if fallback is not None:
            success, reason, *_ = await self._send(fallback, f"reload v{fallback.version}", flush_cache=True)
        else:
            success, reason, *_ = await bounded(self.engine.update_weights_from_disk(
                model_path=self.model_path, weight_version="0", abort_all_requests=True, flush_cache=True),
                self.timeout_s, f"reload v0 from {self.model_path}", self.engine_peer)
        if not success:
            raise RuntimeError(reason)
        self.version = fallback.version if fallback is not None else 0
        await bounded(self.engine.continue_generation(), self.timeout_s, "continue generation", self.engine_peer)

    async def _roll_back(self, version: int, cause: str, err: Exception, fallback) -> None:
        """Still paused: go back to `fallback` (or the model's files), continue, raise WeightLoadError."""
        await self._reload_or_break(fallback, f"v{version} failed ({cause})", f"sglang could not load v{version}",
                                    err)
        raise WeightLoadError(f"sglang could not load v{version} ({cause}); reloaded "
                              f"{describe_target(fallback, self.model_path)}") from err

    async def _reload_or_break(self, fallback, what_failed: str, headline: str, cause: Exception) -> None:
        """`_reload`, then admit again; if the reload fails too, the engine is broken (EngineBroken)."""
        target = describe_target(fallback, self.model_path)
        try:
            await self._reload(fallback)
        except Exception as reload_err:
            self.mark_broken(f"{what_failed} and the rollback to {target} failed too ({reload_err})")
            raise EngineBroken(f"{headline}: {self.broken}") from cause
        self._admit.set()

    # --- the other way in: versions pushed from the learner's GPU (weightsync/engine_push) ------------------

    async def push_join(self, init_info: dict) -> None:
        """Join the learner's weight-update group for this engine (`init_weights_update_group`); a new group
        (the learner opens one after a failure) replaces the old, which is destroyed."""
        success, message = await bounded(self.engine.init_weights_update_group(**init_info), self.timeout_s,
                                         f"join weight group {init_info.get('group_name')}", self.engine_peer)
        if not success:
            raise RuntimeError(f"SGLang could not join the learner's weight group: {message}")
        old, self._push_group = self._push_group, init_info["group_name"]
        if old is not None and old != self._push_group:
            with contextlib.suppress(Exception):  # best effort: it failed, that is why there is a new one
                await bounded(self.engine.destroy_weights_update_group(group_name=old), self.timeout_s,
                              f"destroy weight group {old}", self.engine_peer)

    async def push_begin(self) -> None:
        """Take the load lock and pause as for a staged load; samplers wait until commit or recover."""
        await self._lock.acquire()
        try:
            if self.broken:
                raise EngineBroken(f"sglang cannot take a pushed version: {self.broken}")
            await self._pause()
        except EngineBroken:
            self._lock.release()
            raise
        except Exception as err:
            self.mark_broken(f"pausing for a pushed version failed ({err})")
            self._lock.release()
            raise EngineBroken(self.broken) from err

    async def push_receive(self, update_info: dict) -> None:
        """`update_weights_from_distributed`: SGLang receives one broadcast per tensor while the learner sends."""
        success, message = await bounded(self.engine.update_weights_from_distributed(
            names=update_info["names"], dtypes=update_info["dtypes"], shapes=update_info["shapes"],
            group_name=update_info["group_name"], flush_cache=self.update_mode != "keep",
            weight_version=update_info.get("weight_version")), self.timeout_s,
            f"receive a pushed version over {update_info['group_name']}", self.engine_peer)
        if not success:
            raise RuntimeError(f"SGLang refused the pushed version: {message}")

    async def push_commit(self, version: int) -> None:
        try:
            await self._commit(version, "pushed")
        finally:
            self._lock.release()

    async def push_recover(self, staged) -> None:
        """After a push failed half-way: load `staged` (None: the model's files) in full, then admit again."""
        try:
            await self._reload_or_break(staged, "a pushed version failed", "sglang", None)
        finally:
            self._lock.release()

    def mark_broken(self, reason: str) -> None:
        """No good weights we can vouch for: stay paused for good; waiting and future samples raise."""
        self.broken = f"{reason}; the engine stays paused: restart it"
        self._admit.set()


def describe_target(fallback, model_path: str) -> str:
    return (f"v{fallback.version} from staging slot {fallback.slot}" if fallback is not None
            else f"v0 from {model_path}")
