"""weightsync/engine_push/delta.py: sparse patches between two versions, for vLLM's sparse_nccl engine."""
import torch

from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.engine_push.delta import apply_patches, sparse_patches
from asyncrl.weightsync.layout import plan_layout

SPECS = [("a", "bfloat16", (32, 16)), ("b", "bfloat16", (100,)), ("c", "float32", (4, 4))]


def buckets_of(tensors: dict) -> FlatBuckets:
    buckets = FlatBuckets(plan_layout(SPECS, 1024))
    for name, tensor in tensors.items():
        buckets.put(name, tensor)
    return buckets


def base() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator).to(getattr(torch, dtype)) for name, dtype, shape in SPECS}


def test_patches_carry_exactly_the_changed_elements_and_rebuild_the_new_version():
    old = base()
    new = {name: tensor.clone() for name, tensor in old.items()}
    new["a"][3, 5] += 1.0
    new["a"][31, 0] = -7.0
    new["c"][2, 2] = 0.5
    patches = sparse_patches(buckets_of(old), buckets_of(new))
    assert [name for name, *_ in patches] == ["a", "c"]  # b did not change: no patch
    name, indices, values, shape = patches[0]
    assert indices.dtype == torch.int32 and indices.tolist() == [3 * 16 + 5, 31 * 16 + 0] and shape == (32, 16)
    assert values.dtype == torch.bfloat16
    rebuilt = {name: tensor.clone() for name, tensor in old.items()}
    apply_patches(rebuilt, patches)
    assert all(torch.equal(rebuilt[name], new[name]) for name in new)


def test_a_version_that_moved_too_much_or_changed_layout_goes_dense():
    old = base()
    moved = {name: tensor + 1 for name, tensor in old.items()}
    assert sparse_patches(buckets_of(old), buckets_of(moved)) is None
    other = FlatBuckets(plan_layout(SPECS[:2], 1024))
    assert sparse_patches(other, buckets_of(old)) is None
    assert sparse_patches(buckets_of(old), buckets_of(old)) == []  # nothing changed: an empty patch set


def test_the_store_client_carries_cuda_ipc_handles_pickled_as_vllms_ipc_engine_reads_them():
    """vLLM's IPC trainer hands raw handle tuples; over the store they travel as `ipc_handles_pickled`."""
    import base64
    import pickle

    from asyncrl.weightsync.engine_push.calls import json_safe

    handles = [{"GPU-uuid": (torch.Size([2]), 7, "storage", b"\x00handle")}]
    safe = json_safe({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]], "ipc_handles": handles})
    assert "ipc_handles" not in safe and pickle.loads(base64.b64decode(safe["ipc_handles_pickled"])) == handles
    plain = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    assert json_safe(plain) is plain
