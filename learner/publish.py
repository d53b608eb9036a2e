"""The learner's side of publishing a version: full weights out of FSDP2 shards, bucket by bucket (every rank),
then rank 0's publish, announcement, and the checks and counters of what it sent (`VersionPublisher`).

Every rank runs the same gathers (they are collectives); only rank 0 keeps what it gathers and hands it to the
publisher, which casts to the engine's dtype while copying into its ring (one pass, no intermediate tensor). A
bucket bounds how much gathered-but-unsent weight exists at once on every rank: one bucket, not the model.
"""
import logging
from dataclasses import dataclass
from typing import Iterator

import torch

from asyncrl.learner.lora import adapter_message
from asyncrl.learner.parallel import ParallelState
from asyncrl.weightsync.announcement import WeightsAnnouncement
from asyncrl.weightsync.layout import tensor_bytes
from asyncrl.weightsync.lora_names import adapter_file_name, is_adapter_key
from asyncrl.weightsync.model_files import ModelFilesError, pack

log = logging.getLogger(__name__)


def bucket_names(tensors: dict, bucket_bytes: int) -> list[list[str]]:
    """Consecutive names grouped so each group's full tensors hold about `bucket_bytes` (a larger tensor is a bucket
    of its own)."""
    buckets, current, size = [], [], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def iter_full_weights(model, parallel: ParallelState, dtype: torch.dtype | None, bucket_bytes: int,
                      keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`, or as stored with None) for every entry of the model's state dict (those whose
    name `keep(name)` accepts, when given: a LoRA version's adapter), yielded on rank 0 only; the other ranks run the
    gathers and yield nothing. Tied weights are gathered once and yielded under each name."""
    state = kept_state(model, keep)
    if not parallel.distributed:
        for name, tensor in state.items():
            yield name, _in_dtype(tensor, dtype)
        return
    last_name = {id(tensor): name for name, tensor in state.items()}  # a tied tensor's last entry
    gathered: dict[int, torch.Tensor] = {}
    for names in bucket_names(state, bucket_bytes):
        bucket = []
        for name in names:
            tensor = state[name]
            if id(tensor) not in gathered:
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                gathered[id(tensor)] = _in_dtype(full, dtype) if parallel.is_main else None
            bucket.append((name, gathered[id(tensor)]))
        if parallel.is_main:
            yield from bucket
        for name in names:  # the bucket goes before the next is gathered (a tied tensor stays until its last name)
            if last_name[id(state[name])] == name:
                gathered.pop(id(state[name]))


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Detached, and cast to `dtype` unless it is None (the publisher casts in its copy)."""
    return tensor.detach() if dtype is None else tensor.detach().to(dtype)


def kept_state(model, keep=None) -> dict:
    """The model's state dict, or the part of it `keep(name)` accepts (every rank filters alike, so the gathers
    stay collective)."""
    state = model.state_dict()
    return state if keep is None else {name: tensor for name, tensor in state.items() if keep(name)}


def publish_bytes(specs: list) -> int:
    """Bytes of the tensors `specs` describes (what a version of them weighs on the wire, before alignment)."""
    return sum(tensor_bytes(name, dtype, shape, "") for name, dtype, shape in specs)


def announcement_key(announcement: WeightsAnnouncement) -> tuple:
    """(layout fingerprint, bucket checksums): equal keys mean byte-identical versions."""
    return announcement.fingerprint, tuple(announcement.checksums)


def repeats_previous(previous: tuple | None, message: WeightsAnnouncement) -> tuple[bool, tuple]:
    """(whether the version `message` announces has exactly the bytes of the one before it: the same layout and
    every bucket's checksum the same, the key identifying this one for the next call). After a trained step that
    means the weight sync stopped moving, and the engines go on sampling the old policy, which reads exactly like
    staleness (verl #7495: a LoRA adapter that silently stopped reaching the engine)."""
    key = announcement_key(message)
    return previous == key, key


@dataclass(frozen=True)
class GatherSettings:
    """How every rank gathers a version for rank 0 to publish: learner.lora (the adapter alone when enabled),
    weightsync.dtype (the engine's dtype, named in the specs), and learner.gather_bucket_mb in bytes."""
    lora: object
    dtype: str
    bucket_bytes: int


@dataclass
class OutgoingVersion:
    """What the publisher takes for one version: the (name, tensor) iterator (yielding on rank 0 only), the specs,
    the announcement's extra fields, and what a full version of the model weighs (for the bytes share)."""
    weights: Iterator
    specs: list
    extra: dict | None
    full_bytes: int


def outgoing_version(model, parallel: ParallelState, lora, dtype: str, bucket_bytes: int) -> OutgoingVersion:
    """The whole model's state; with learner.lora (`lora.enabled`) its adapter alone, named as PEFT's adapter
    files name it, with the adapter's settings as the message's `lora` entry: the engines serve it as an adapter on
    the base model they already hold (generator/engines/lora_adapter.py)."""
    keep = is_adapter_key if lora.enabled else None
    weights = iter_full_weights(model, parallel, None, bucket_bytes, keep=keep)
    every = [(name, dtype, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]  # one pass for both
    specs = [spec for spec in every if keep is None or keep(spec[0])]
    full_bytes = publish_bytes([spec for spec in every if not is_adapter_key(spec[0])])
    if not lora.enabled:
        return OutgoingVersion(weights, specs, None, full_bytes)
    renamed = ((adapter_file_name(name), tensor) for name, tensor in weights)
    return OutgoingVersion(renamed, [(adapter_file_name(name), dtype_, shape) for name, dtype_, shape in specs],
                           {"lora": adapter_message(lora)}, full_bytes)


def model_files_for(model_path: str):
    """(archive, digest) of the model's config and tokenizer for generators with nothing shared, or None (logged)
    when the directory cannot be packed: generators then need the model at the same path."""
    try:
        return pack(model_path)
    except (ModelFilesError, OSError) as err:
        log.warning("learner: generators on other hosts cannot get the model files (%s); they need %s themselves",
                    err, model_path)
        return None


def catchup_metrics(catchup) -> dict:
    """The catch-up server's counters, and what it sent over what full copies would have sent; {} without one."""
    if catchup is None or not catchup.full_bytes:
        return {}
    return {"weightsync/catchup_served": float(catchup.served),
            "weightsync/catchup_deltas": float(catchup.deltas_served),
            "weightsync/catchup_deltas_prepared": float(catchup.deltas_prepared),
            "weightsync/catchup_prepared_used": float(catchup.prepared_used),
            "weightsync/catchup_bytes_frac": catchup.sent_bytes / catchup.full_bytes}


class VersionPublisher:
    """Rank 0 publishes a version (weightsync's publisher: the ring, the data plane, the catch-up server), then
    announces it to the buffer: only then may generators be admitted against it (buffer/staleness.py). It keeps
    the newest published version, the last publish's bytes (logged with the step that published it), and counts
    versions that repeat the previous one's bytes after a trained step. `unchanged_until`: versions up to this one
    may rightly repeat (the critic's warmup leaves the policy as it was); -1 when none may."""

    def __init__(self, publisher, buffer, version: int, unchanged_until: int = -1):
        self.publisher = publisher
        self.buffer = buffer
        self.version = version
        """The newest published (announced) version: admission's v; how far training moved on when an evaluation
        lands."""
        self.unchanged_until = unchanged_until
        self.unchanged_versions = 0  # versions published with the previous one's bytes after a trained step
        self._last_key: tuple | None = None  # (fingerprint, checksums) of the last version published
        self._metrics: dict = {}

    def publish(self, weights, version: int, specs: list, extra: dict | None = None, full_bytes: int = 0,
                moved: bool = True) -> None:
        """Publish `version` and announce it. `full_bytes`: what a full version weighs, for the share a LoRA
        version's adapter sends. `moved`: the step changed the weights (a batch whose advantages are all 0 did not,
        and may rightly repeat the previous version's bytes)."""
        sent = self.publisher.publish(weights, version, specs, extra=extra)
        self.check_changed(sent, moved)
        self._metrics = {**catchup_metrics(self.publisher.catchup), "weightsync/publish_bytes": float(sent.nbytes),
                         "weightsync/publish_bytes_frac": sent.nbytes / max(full_bytes, 1),
                         "weightsync/unchanged_versions": float(self.unchanged_versions)}
        self.buffer.announce_weights(sent)
        self.buffer.set_version(version)
        self.version = version

    def check_changed(self, sent: WeightsAnnouncement, moved: bool = True) -> None:
        """Counts and logs a version that repeats the previous one's bytes after a trained step (repeats_previous
        says why that matters)."""
        repeated, self._last_key = repeats_previous(self._last_key, sent)
        if repeated and moved and sent.version > self.unchanged_until:
            self.unchanged_versions += 1
            log.error("weight sync: v%d sends exactly the bytes of the version before it (%d bytes%s) although a step "
                      "was trained: the generators will sample the old policy (learning rate 0? an adapter that "
                      "does not train?)", sent.version, sent.nbytes,
                      ", the LoRA adapter" if sent.lora is not None else "")

    def take_metrics(self) -> dict:
        """The last publish's metrics, once: a step that published nothing logs none."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    def close(self) -> None:
        self.publisher.close()
