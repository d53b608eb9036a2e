"""DeepSpeed's Ulysses (`learner.sp_impl=deepspeed`): DeepSpeed's `DistributedAttention` does the two all-to-alls
around the same inner attention the native path uses (learner/sequence_attention.py::inner_attention), so packing,
sliding windows, soft-capping and flash-attn's varlen kernel behave alike on both paths.

`DistributedAttention` talks through `deepspeed.comm`, which must wrap the process group torch.distributed already
runs (`deepspeed.init_distributed` on an initialised torch.distributed adopts it rather than starting another). On
CPU that first call compiles DeepSpeed's shared-memory op with g++ (about 40 s on 2 cores, then cached under
`~/.cache/torch_extensions`); it is the price of choosing this implementation, and the reason `native` is the
default.
"""
import torch.distributed as dist

from asyncrl.learner.sequence_attention import inner_attention, varlen_kernel

INSTALL_HINT = 'learner.sp_impl=deepspeed needs DeepSpeed: pip install -e ".[deepspeed]"'


class DeepSpeedMissing(ImportError):
    """learner.sp_impl=deepspeed on a machine without DeepSpeed."""


def local_attention(query, key, value, segment_ids=None, scale=None, dropout: float = 0.0, window=None,
                    softcap=None):
    """What `DistributedAttention` runs between its all-to-alls: q [b, S, h/sp, d] and k/v [b, S, kv/sp, d] (the
    whole sequence, a slice of the heads) -> [b, S, h/sp, d]."""
    out = inner_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), segment_ids, scale,
                          dropout, varlen_kernel(query.device), window=window, softcap=softcap)
    return out.transpose(1, 2)


def deepspeed_exchange(sp_group):
    """DeepSpeed's `DistributedAttention` over `sp_group`, wrapping `local_attention`: called with q/k/v laid out
    [b, s_local, heads, d] (scatter the heads, dim 2; gather the sequence, dim 1), it returns [b, s_local, h, d]."""
    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
    except ImportError as error:
        raise DeepSpeedMissing(f"{INSTALL_HINT} ({error})") from error
    if not dist.is_initialized():
        raise RuntimeError("learner.sp_impl=deepspeed needs torch.distributed initialised first (init_parallel)")
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # adopts the running process group
    return DistributedAttention(local_attention, sp_group, scatter_idx=2, gather_idx=1)
