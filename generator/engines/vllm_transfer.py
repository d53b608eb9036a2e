"""asyncrl's shared-memory staging as one more engine of vLLM's public weight-transfer API.

vLLM receives weights for RL through `init_weight_transfer_engine`, `start_weight_update`, `update_weights` and
`finish_weight_update(weight_version=...)`, and picks the transport from `WeightTransferConfig.backend` out of its
`WeightTransferEngineFactory` registry (`nccl`, `sparse_nccl` and `ipc` ship with vLLM). This module adds
`asyncrl_shm`: each `update_weights` call names one bucket of a complete, checksummed version in the generator's
staging mapping (weightsync/receiver.py), and the worker hands vLLM typed views of its bytes, without a copy before
vLLM's own, in the layout of the model's files (checkpoint_layout.py: transformers fuses MoE experts in memory). It
is registered in every vLLM process through vLLM's plugin entry point (`vllm.general_plugins`, in setup.py), so the
CPU tests drive exactly the calls a GPU engine receives.

Loading follows vLLM's layerwise reload (what its own `nccl` engine does): `start_weight_update` opens it, every
bucket's tensors go through `model.load_weights`, `finish_weight_update` finalizes it. That is the reload that also
works after the CPU backend's weight prepacking (docs/platform.md).

On a GPU the same engine also takes versions pushed from the learner's GPU (weightsync/engine_push) over vLLM's
own transfer engines, composed, not copied: an init naming a `transport` (`nccl`, `sparse_nccl`, `ipc`) opens
vLLM's engine of that name inside this one (`TRANSPORTS`), and an update naming it is received by it. One
registered backend serves them all because vLLM configures one per engine, and a generator needs the staging path
too: to catch up on a version it missed, and to go back to a complete version after a push that failed half-way.

Each update round (start .. finish) uses one transport, fixed by its first update: the round then opens and closes
the way that transport's own engine does (the dense ones through the layerwise reload, `sparse_nccl` in place).

Never half-loaded: if a bucket fails (a shape vLLM refuses, a staging slot rewritten underneath), the engine
finalizes the reload it opened before raising. Layers that were complete hold the new weights, the others their
old ones or a partial mix, but no layer is left on the meta device with buffered weights that a later reload would
replay. The generator then reloads its last good version through the same calls before it samples again
(vllm_engine.py), which overwrites every tensor.
"""
import json
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from asyncrl.generator.engines.checkpoint_layout import CheckpointLayout
from asyncrl.weightsync.announcement import WeightsAnnouncement
from asyncrl.weightsync.layout import layout_of
from asyncrl.weightsync.receiver import STAGING_SLOTS
from asyncrl.weightsync.shm_ring import ShmRing

BACKEND = "asyncrl_shm"
"""The name this engine is registered under in vLLM's WeightTransferEngineFactory."""
TRANSPORTS = {
    "nccl": ("vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferEngine"),
    "sparse_nccl": ("vllm.distributed.weight_transfer.sparse_nccl_engine", "SparseNCCLWeightTransferEngine"),
    "ipc": ("vllm.distributed.weight_transfer.ipc_engine", "IPCWeightTransferEngine"),
}
"""vLLM's own transfer engines a pushed version can come through."""


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous for staging (the mapping is named by each update). With `transport`: open vLLM's
    engine of that name for pushed versions, with `info` (its init info's keywords)."""

    transport: str = ""
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.transport and self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; asyncrl_shm composes {sorted(TRANSPORTS)}")


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One bucket of a staged version, or (with `path`) the model's own safetensors files, the last good version
    of a generator that has loaded nothing else yet."""

    version: int = -1
    ring_path: str = ""
    slot: int = -1
    bucket: int = -1
    message_json: str = ""
    """The version's announcement as JSON (WeightsAnnouncement.to_wire), whose layout says where each tensor sits."""
    path: str = ""
    names: list = field(default_factory=list)
    """Only with `path`: which tensors of the files to load ([] = all)."""
    transport: str = ""
    """A pushed version: the transport it comes through, and `info`, its update info's keywords."""
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.path and not self.transport and (self.version < 0 or not self.ring_path or self.slot < 0 or self.bucket < 0
                              or not self.message_json):
            raise ValueError("an asyncrl_shm update names a staged bucket (version, ring_path, slot, bucket, "
                             "message_json), a model directory (path) or a pushed version (transport)")


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._rings: dict = {}  # ring path -> ShmRing, mapped once per layout
        self._pushed: dict = {}  # transport -> vLLM's engine for it, once the learner's side was joined
        self._round: str | None = None  # the transport of the open round ("shm" for staging), None between rounds
        self._layout = None  # checkpoint_layout.CheckpointLayout of the model, built at the first staged bucket

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        """Open vLLM's engine for a transport (a new one replaces the old: the learner opens a new group after a
        failure)."""
        if not init_info.transport:
            return
        import importlib

        module, name = TRANSPORTS[init_info.transport]
        self._shutdown_pushed(init_info.transport)
        engine = getattr(importlib.import_module(module), name)(self.config, self.vllm_config, self.device, self.model)
        engine.init_transfer_engine(engine.parse_init_info(init_info.info))
        self._pushed[init_info.transport] = engine

    def start_weight_update(self) -> None:
        """The round opens at its first update, once its transport is known. A round left open (a push whose
        learner never finished it) is closed first, so no reload is ever opened twice."""
        if self._round is not None:
            self.finish_weight_update()

    def finish_weight_update(self) -> None:
        round_, self._round = self._round, None
        if round_ == "shm":
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
        elif round_ is not None:
            self._pushed[round_].finish_weight_update()

    def _open_round(self, transport: str) -> None:
        if self._round == transport:
            return
        if self._round is not None:
            raise RuntimeError(f"an update through {transport} inside a round opened by {self._round}")
        if transport == "shm":
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
        else:
            self._pushed[transport].start_weight_update()
        self._round = transport

    def update_weights(self, update_info: dict) -> None:
        """The base class's update_weights plus the consistency guarantee of this module's docstring. (It also
        skips the base class's `torch.accelerator.synchronize()`, which raises on a machine without an
        accelerator; these copies are synchronous.)"""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException as err:
            try:
                self.finish_weight_update()
            except Exception as again:  # the worker cannot vouch for the model: the generator reloads or breaks
                raise RuntimeError(f"{err}; closing the reload after it failed too: {again}") from err
            raise
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if update_info.transport:
            engine = self._pushed.get(update_info.transport)
            if engine is None:
                raise RuntimeError(f"a version pushed over {update_info.transport} arrived before the learner's side "
                                   f"of it was joined")
            engine.model, engine.model_config = self.model, self.model_config  # the current target
            self._open_round(update_info.transport)
            engine.receive_weights(engine.parse_update_info(update_info.info))
            return
        self._open_round("shm")
        if update_info.path:
            self.model.load_weights(_safetensors(update_info.path, set(update_info.names)))
            return
        layout = layout_of(WeightsAnnouncement.from_wire(json.loads(update_info.message_json)))
        ring = self._rings.get(update_info.ring_path)
        if ring is None or ring.layout.fingerprint != layout.fingerprint:
            if ring is not None:
                ring.close()
            ring = ShmRing(update_info.ring_path, layout, STAGING_SLOTS, create=False)
            self._rings[update_info.ring_path] = ring
        where = f"bucket {update_info.bucket} of {len(layout.bucket_sizes)} of v{update_info.version}"
        before = ring.stamp(update_info.slot)
        if before[0] % 2 or before[1] != update_info.version:
            raise RuntimeError(f"{where}: staging slot {update_info.slot} of {update_info.ring_path} holds "
                               f"v{before[1]} (sequence {before[0]}), not a complete v{update_info.version}")
        if self._layout is None:
            self._layout = CheckpointLayout.for_config(self.model_config.hf_config,
                                                       self.model_config.trust_remote_code)
        try:  # any failure, the layout's conversion included, names the bucket and version it was in
            tensors = self._layout.convert(ring.buckets(update_info.slot).tensors(update_info.bucket))
            if not hasattr(self.model, "lm_head"):
                # A tied head is in the learner's state dict twice (embeddings and lm_head.weight). vLLM's Qwen
                # models hold a head of their own, which a reload unties, so they need both; its Gemma 2 computes
                # the logits from the embeddings, has no head, and fails on the name.
                tensors = [(name, tensor) for name, tensor in tensors if name != "lm_head.weight"]
            self.model.load_weights(tensors)
        except Exception as err:
            raise RuntimeError(f"{where}: {type(err).__name__}: {err}") from err
        if ring.stamp(update_info.slot) != before:
            raise RuntimeError(f"{where}: staging slot {update_info.slot} changed while it was loading")

    def shutdown(self) -> None:
        for transport in list(self._pushed):
            self._shutdown_pushed(transport)
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()

    def _shutdown_pushed(self, transport: str) -> None:
        engine = self._pushed.pop(transport, None)
        if engine is not None:
            engine.shutdown()


def _safetensors(path: str, names: set):
    import glob
    import os

    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                if not names or name in names:
                    yield name, handle.get_tensor(name)


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in every process it starts (its engine core and
    workers load the general plugins), before any engine is created. Idempotent."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "ShmWeightTransferEngine")
    except ValueError:  # registered already: plugins load once per process, but be safe
        pass
