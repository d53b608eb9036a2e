"""Full weights out of FSDP2 shards, bucket by bucket, for the weight publisher on rank 0.

Every rank runs the same gathers (they are collectives); only rank 0 keeps what it gathers and hands it to the
publisher, which casts to the engine's dtype while copying into its ring (one pass, no intermediate tensor). A
bucket bounds how much gathered-but-unsent weight exists at once on every rank: one bucket, not the model.
"""
from typing import Iterator

import torch

from asyncrl.learner.parallel import ParallelState


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


def iter_full_weights(model, parallel: ParallelState, dtype: torch.dtype | None,
                      bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`, or as stored with None) for every entry of the model's state dict, yielded on
    rank 0 only; the other ranks run the gathers and yield nothing. Tied weights are gathered once and yielded under
    each name."""
    state = model.state_dict()
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


def weight_specs(model, dtype: str) -> list[tuple[str, str, tuple]]:
    """(name, dtype, full shape) of every entry iter_full_weights yields, in its order, without gathering anything
    (a sharded DTensor knows its global shape): the weight layout is planned before the first bucket is gathered."""
    return [(name, dtype, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]
