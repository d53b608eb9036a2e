"""Full weights out of FSDP2 shards, bucket by bucket, for the weight publisher on rank 0.

Every rank runs the same gathers (they are collectives); only rank 0 keeps what it gathers and hands it to the
publisher, which casts to the engine's dtype while copying into its ring (one pass, no intermediate tensor). A
bucket bounds how much gathered-but-unsent weight exists at once on every rank: one bucket, not the model.
"""
from dataclasses import dataclass
from typing import Iterator

import torch

from asyncrl.learner.lora import adapter_message
from asyncrl.learner.parallel import ParallelState
from asyncrl.weightsync.lora_names import adapter_file_name, is_adapter_key
from asyncrl.weightsync.layout import tensor_bytes


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


def repeats_previous(previous: tuple | None, message: dict) -> tuple[bool, tuple]:
    """(whether the version `message` announces has exactly the bytes of the one before it: the same layout and
    every bucket's checksum the same, the key identifying this one for the next call). After a trained step that
    means the weight sync stopped moving, and the engines go on sampling the old policy, which reads exactly like
    staleness (verl #7495: a LoRA adapter that silently stopped reaching the engine)."""
    key = (message["fingerprint"], tuple(message["checksums"]))
    return previous == key, key


@dataclass(frozen=True)
class GatherSettings:
    """How every rank gathers a version for rank 0 to publish: learner.lora (the adapter alone when enabled),
    weightsync.dtype (the engine's dtype, named in the specs), and learner.publish_bucket_mb in bytes."""
    lora: object
    dtype: str
    bucket_bytes: int


@dataclass
class OutgoingVersion:
    """What the publisher takes for one version: the (name, tensor) iterator (yielding on rank 0 only), the specs,
    the control message's extra fields, and what a full version of the model weighs (for the bytes share)."""
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
