"""Runs inside vLLM's worker process (AsyncEngineArgs.worker_extension_cls): loads a staged version straight from
the generator's staging mapping.

Why a worker extension: on CPU the only working reload is `model_runner.reload_weights(...)` (docs/platform.md),
and tensors passed through `collective_rpc` arrive as lists; paths and small strings travel fine. So the generator
passes the staging ring's path, the slot and the control message, and the worker maps the ring once and hands
vLLM typed views of the slot's bytes (no file, no copy before vLLM's own). The slot's seqlock is checked after the
load: a slot changed underneath it would be an error, never silently half-new weights.
"""
import json

from asyncrl.weightsync.layout import from_message
from asyncrl.weightsync.receiver import STAGING_SLOTS
from asyncrl.weightsync.shm_ring import ShmRing


class StagedWeightsLoader:
    """Mixed into vLLM's worker class; reached with collective_rpc("asyncrl_load_staged", args=...)."""

    def asyncrl_load_staged(self, ring_path: str, slot: int, version: int, message_json: str) -> int:
        layout = from_message(json.loads(message_json))
        rings = self.__dict__.setdefault("_asyncrl_rings", {})
        ring = rings.get(ring_path)
        if ring is None or ring.layout.fingerprint != layout.fingerprint:
            ring = ShmRing(ring_path, layout, STAGING_SLOTS, create=False)  # mapped once per layout
            rings[ring_path] = ring
        before = ring.stamp(slot)
        if before[0] % 2 or before[1] != version:
            raise RuntimeError(f"staging slot {slot} of {ring_path} holds v{before[1]} (sequence {before[0]}), "
                               f"not a complete v{version}")
        self._asyncrl_reload(weights_iterator=ring.buckets(slot).tensors())
        if ring.stamp(slot) != before:
            raise RuntimeError(f"staging slot {slot} of {ring_path} changed while v{version} was loading")
        return version

    def asyncrl_load_path(self, weights_path: str) -> None:
        """The model's own files: the last good version when nothing was staged yet."""
        self._asyncrl_reload(weights_path=weights_path)

    def _asyncrl_reload(self, **source) -> None:
        """`reload_weights`, leaving the model consistent if it fails midway.

        vLLM's in-place reload (0.32, model_loader/reload/layerwise.py) moves every layer to the meta device, buffers
        each layer's weights until the layer is complete, then processes and copies them into the kernel tensors.
        A failure midway leaves layers on meta with stale buffers, and those buffers are replayed by the next
        reload, so even reloading the last good version fails (the "dead on next generate" of docs/platform.md).
        Dropping the buffers and finalizing puts every unfinished layer's kernel tensors back; the caller then
        reloads a good version over the now-consistent model.
        """
        try:
            self.model_runner.reload_weights(is_checkpoint_format=True, **source)
        except BaseException:
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, finalize_layerwise_reload

            model = self.model_runner.get_model()
            for layer in model.modules():
                info = LAYERWISE_INFO.get(layer)
                if info is not None and info.can_load():
                    info.loaded_weights, info.load_numel = [], 0
            finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
            raise
