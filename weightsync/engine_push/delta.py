"""What changed between two versions, as flat-index patches for vLLM's `sparse_nccl` engine (pure functions).

Why it pays: weights sent in bf16 keep most of their elements bit-identical from one RL step to the next (a small
learning rate moves an fp32 master weight by less than half a bf16 ulp), so a patch of (index, value) pairs is
much smaller than the tensor. It does not pay when most elements moved: an int32 index costs 4 bytes beside each
value, so past `max_fraction` of the dense bytes the whole version is sent dense instead.
"""
import torch

from asyncrl.weightsync.buckets import FlatBuckets


def sparse_patches(previous: FlatBuckets, current: FlatBuckets, max_fraction: float = 0.5):
    """[(name, int32 flat indices, values, full shape)] of the elements of `current` that differ from `previous`
    (tensors with no change are left out), or None when the patches would cost more than `max_fraction` of
    sending `current` dense, or the layouts differ (a dense send is due)."""
    if previous.layout.fingerprint != current.layout.fingerprint:
        return None
    patches, patch_bytes = [], 0
    budget = max_fraction * current.layout.total_bytes
    for entry in current.layout.entries:
        new, old = current.view(entry).reshape(-1), previous.view(entry).reshape(-1)
        changed = torch.nonzero(new != old).reshape(-1)
        if changed.numel() == 0:
            continue
        patch_bytes += changed.numel() * (4 + new.element_size())
        if patch_bytes > budget:
            return None
        patches.append((entry.name, changed.to(torch.int32), new[changed].clone(), tuple(entry.shape)))
    return patches


def apply_patches(target: dict, patches) -> None:
    """Apply `sparse_patches` output to `target` (name -> tensor) in place: what the engine's receive does, for
    tests and for checking a patch set."""
    for name, indices, values, _ in patches:
        target[name].view(-1)[indices.long()] = values
