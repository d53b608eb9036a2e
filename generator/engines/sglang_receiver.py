"""The SGLang side of weight sync: one control message per version, one pause -> load -> resume per message.

Written against SGLang 0.5.x (pause modes need >= 0.5.6; checked against sgl-project/sglang's
`tokenizer_communicator_mixin.py`, `tokenizer_manager.py`, `entrypoints/engine.py` and
`docs/advanced_features/sglang_for_rl.md`). The engine handle is anything with the async methods of
`sglang_engine.AsyncSglangEngine` (the real engine) or `tests/fakes/fake_sglang.FakeSglangEngine`.

Control message (a dict, one per version):
  version, names, dtypes, shapes                      the tensors the learner broadcasts, in order
  group = {master_address, master_port, world_size,   the torch.distributed group to receive them on;
           rank_offset, group_name, backend,          `generation` changes whenever the learner rebuilds it
           [generation]}                              (absent: the other fields are the generation)
  path (optional)                                     an on-disk copy of this version (the shm publisher's
                                                      directory): the rollback target if a later load fails

What a version costs, and what it guarantees (DESIGN.md §6):
  * The group is joined once per generation, before anything is paused; a new generation destroys the old
    group and joins the new one. (SGLang's scheduler joins synchronously, so its decoding stalls until the
    learner's rendezvous completes; our timeout bounds our wait, not that stall.)
  * Admission closes, generation pauses, `update_weights_from_distributed(..., flush_cache=True)` loads every
    tensor and resets the prefix cache, `weight_version` is recorded, generation continues, admission opens.
    No request is sampled while weights are partly written: new requests wait at admission, running ones are
    paused or gone (see update modes).
  * A failed load stays paused, aborts whatever is still queued, reloads the last good version from disk with
    `update_weights_from_disk(last_good_path)` (SGLang's own error says a failed distributed update leaves
    "the full weights ... partially updated. Please discard the whole weights", and the distributed path has
    no copy to go back to), continues, and raises `WeightLoadError` naming the version and the cause. If the
    rollback fails too, the receiver is `broken`: it stays paused and every sample raises, so the process can
    be restarted (generators may restart at any time, §6 membership).
  * Every wait is bounded by `timeout_s`; a timeout names the peer (`address:port group 'name'`, or the engine).
    A timed-out transfer marks the group generation failed (the collective may be wedged): later messages of
    that generation are refused at once until the learner announces a new one. Giving up does not unblock
    SGLang's scheduler, which stays in the collective until torch's own timeout; a rollback queued behind it
    times out too, and the receiver is then `broken` (restart the generator).

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

log = logging.getLogger(__name__)

PAUSE_MODES = {"wait": "abort", "abort": "abort", "keep": "retract"}
"""SGLang pause mode used for each asyncrl update mode (see the module docstring for why)."""
GROUP_KEYS = ("master_address", "master_port", "world_size", "rank_offset", "group_name", "backend")


class SglangTimeoutError(TimeoutError):
    """A bounded wait on SGLang or on the learner's group ran out; the message names the peer."""


class UpdateRejected(RuntimeError):
    """SGLang answered the load with success=False (the transfer itself completed or failed cleanly)."""


async def bounded(awaitable, timeout_s: float, what: str, peer: str):
    """Await with a deadline whose error says what was awaited and who did not answer."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise SglangTimeoutError(f"{what}: no answer from {peer} within {timeout_s:g}s") from None


def describe_peer(group: dict) -> str:
    return f"{group['master_address']}:{group['master_port']} group {group['group_name']!r}"


class SglangWeightReceiver:
    def __init__(self, engine, update_mode: str, model_path: str, timeout_s: float, drain_timeout_s: float,
                 version: int = 0):
        if update_mode not in PAUSE_MODES:
            raise ValueError(f"sglang update_mode must be one of {tuple(PAUSE_MODES)}, got {update_mode!r}")
        self.engine = engine
        self.update_mode = update_mode
        self.timeout_s = timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.version = version
        self.good_path, self.good_version = model_path, version  # newest version with a copy on disk
        self.broken: str | None = None  # set when even the rollback failed: the engine must be restarted
        self.engine_peer = f"sglang engine ({model_path})"
        self._group_key = None  # generation of the group we are in; None: not in one
        self._group: dict | None = None
        self._group_failed = None  # generation whose transport failed; waits for the learner to rebuild it
        self._admit = asyncio.Event()
        self._admit.set()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._lock = asyncio.Lock()  # one load at a time
        self._fallback = None  # the last good staged version, during a staged load

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

    # --- the two ways in: distributed (one message per version) and disk ----------------------------------

    async def apply(self, message: dict) -> None:
        """Join the message's group if needed, then load its version; WeightLoadError if it did not load."""
        version = message["version"]
        async with self._lock:
            self._check_usable(version)
            group = message.get("group")
            if not group or any(key not in group for key in GROUP_KEYS):
                raise WeightLoadError(f"sglang v{version}: control message needs group with {GROUP_KEYS}")
            await self._ensure_group(group, version)  # before pausing: generation runs during the rendezvous
            peer = describe_peer(group)

            def receive():
                return bounded(self.engine.update_weights_from_distributed(
                    names=list(message["names"]), dtypes=list(message["dtypes"]),
                    shapes=[list(shape) for shape in message["shapes"]], group_name=group["group_name"],
                    flush_cache=self.update_mode != "keep", weight_version=str(version)),
                    self.timeout_s, f"receive v{version}", peer)

            try:
                await self._load(version, receive, peer)
            except WeightLoadError as err:
                if not isinstance(err.__cause__, UpdateRejected):
                    self._group_failed = self._group_key  # the collective may be wedged: wait for a new group
                raise
            if message.get("path"):
                self.good_path, self.good_version = message["path"], version

    async def load_staged(self, staged, fallback=None) -> None:
        """A version staged in shared memory (weightsync/receiver.py), sent with `update_weights_from_tensor`; a
        failed load goes back to `fallback` (the last good staged version) the same way, or to the disk copy."""
        version = staged.version
        async with self._lock:
            self._check_usable(version)
            self._fallback = fallback

            def load():
                return bounded(self.engine.update_weights_from_tensor(
                    named_tensors=list(staged.buckets.tensors()), flush_cache=self.update_mode != "keep",
                    weight_version=str(version)), self.timeout_s, f"load v{version} from staging",
                    self.engine_peer)

            try:
                await self._load(version, load, f"staging slot {staged.slot}")
            finally:
                self._fallback = None

    async def load_from_disk(self, directory: str, version: int) -> None:
        """Load a published directory (the shm backend): the same pause discipline, then `good_path` moves."""
        async with self._lock:
            self._check_usable(version)

            def load():
                return bounded(self.engine.update_weights_from_disk(
                    model_path=directory, weight_version=str(version), flush_cache=self.update_mode != "keep"),
                    self.timeout_s, f"load v{version} from {directory}", self.engine_peer)

            await self._load(version, load, directory)
            self.good_path, self.good_version = directory, version

    async def _load(self, version: int, start_update, source: str) -> None:
        """pause -> update (`start_update()`, bounded) -> record the version -> resume; on failure roll back."""
        try:
            await self._pause()
            success, reason, *_ = await start_update()  # SGLang answers (success, message[, num_paused])
            if not success:
                raise UpdateRejected(reason)
        except Exception as err:
            await self._roll_back(version, f"{source}: {err}", err)
        self.version = version
        try:
            await self._resume()
        except Exception as err:
            self._mark_broken(f"v{version} loaded but generation could not resume ({err})")
            raise EngineBroken(f"sglang v{version}: {self.broken}") from err

    # --- steps --------------------------------------------------------------------------------------------

    def _check_usable(self, version: int) -> None:
        if self.broken:
            raise EngineBroken(f"sglang v{version} not loaded: {self.broken}")

    async def _ensure_group(self, group: dict, version: int) -> None:
        """Join once per generation, leaving the old group first; we pause nothing here."""
        key = group.get("generation", tuple(group[k] for k in GROUP_KEYS))
        peer = describe_peer(group)
        if key == self._group_key:
            if self._group_failed == key:
                raise WeightLoadError(f"sglang v{version} not loaded: the transfer on {peer} failed earlier; "
                                      "waiting for the learner to announce a new group generation")
            return
        if self._group is not None:
            old = self._group
            self._group_key = self._group = None
            try:
                await bounded(self.engine.destroy_weights_update_group(group_name=old["group_name"]),
                              self.timeout_s, "leave weight-update group", describe_peer(old))
            except Exception as err:  # leaving is best effort: the old learner may be gone
                log.warning("sglang: could not leave %s: %s", describe_peer(old), err)
        try:
            success, reason = await bounded(self.engine.init_weights_update_group(
                master_address=group["master_address"], master_port=int(group["master_port"]),
                rank_offset=int(group["rank_offset"]), world_size=int(group["world_size"]),
                group_name=group["group_name"], backend=group["backend"]),
                self.timeout_s, "join weight-update group", peer)
        except Exception as err:
            raise WeightLoadError(f"sglang v{version} not loaded: could not join {peer}: {err}") from err
        if not success:
            raise WeightLoadError(f"sglang v{version} not loaded: could not join {peer}: {reason}")
        self._group_key, self._group, self._group_failed = key, dict(group), None

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

    async def _roll_back(self, version: int, cause: str, err: Exception) -> None:
        """Still paused: abort what is queued, reload the last good copy from disk, continue, raise."""
        try:
            # Aborting first frees the model-update lock held by queued requests (the disk reload takes it).
            await bounded(self.engine.pause_generation(mode="abort"), self.timeout_s, "abort before rollback",
                          self.engine_peer)
            if self._fallback is not None:  # the last good version is still staged in shared memory
                success, reason, *_ = await bounded(self.engine.update_weights_from_tensor(
                    named_tensors=list(self._fallback.buckets.tensors()), flush_cache=True,
                    weight_version=str(self._fallback.version)), self.timeout_s,
                    f"reload v{self._fallback.version} from staging", self.engine_peer)
                good_version = self._fallback.version
            else:
                success, reason, _ = await bounded(self.engine.update_weights_from_disk(
                    model_path=self.good_path, weight_version=str(self.good_version), abort_all_requests=True,
                    flush_cache=True), self.timeout_s, f"reload v{self.good_version}", self.engine_peer)
                good_version = self.good_version
            if not success:
                raise RuntimeError(reason)
            self.version = good_version
            await bounded(self.engine.continue_generation(), self.timeout_s, "continue generation",
                          self.engine_peer)
        except Exception as rollback_err:
            self._mark_broken(f"v{version} failed ({cause}) and the rollback to v{self.good_version} from "
                              f"{self.good_path} failed too ({rollback_err})")
            raise EngineBroken(f"sglang could not load v{version}: {self.broken}") from err
        self._admit.set()
        raise WeightLoadError(f"sglang could not load v{version} ({cause}); reloaded v{self.good_version} "
                              f"from {self.good_path}") from err

    def _mark_broken(self, reason: str) -> None:
        """No good weights we can vouch for: stay paused for good; waiting and future samples raise."""
        self.broken = f"{reason}; the engine stays paused: restart it"
        self._admit.set()
