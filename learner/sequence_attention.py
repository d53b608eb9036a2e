"""The attention each Ulysses rank runs on the whole sequence and its slice of the heads, between the two
all-to-alls: flash-attn's varlen kernel on CUDA (cu_seqlens from the packed segments, no [S, S] mask), sdpa with a
block-diagonal causal mask on CPU.

Its own module because both exchanges run it: our all-to-all (learner/ulysses.py) and DeepSpeed's
`DistributedAttention` (learner/ulysses_deepspeed.py), which ulysses.py imports only when chosen; so packing,
sliding windows and soft-capping behave alike on both paths, and neither module imports the other back.
"""
import torch
import torch.nn.functional as F

from asyncrl.learner.precision import LOW_PRECISION, in_fp32


def varlen_kernel(device: torch.device):
    """flash-attn's `flash_attn_varlen_func` on CUDA when it is installed, else None (sdpa with a mask)."""
    if device.type != "cuda":
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def cu_seqlens(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sequence starts (int32, [n+1]) and the longest length, for flat segments laid out contiguously."""
    flat = segment_ids.reshape(-1)
    change = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
    change[1:] = flat[1:] != flat[:-1]
    starts = torch.nonzero(change).reshape(-1)
    bounds = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def inner_attention(q, k, v, segment_ids, scale, dropout: float, kernel=None, window=None, softcap=None):
    """Causal attention over the full sequence: q/k [b, h(_kv), S, d], v [b, h_kv, S, d_v] -> [b, h, S, d_v] (d_v
    differs from d in latent attention, MLA).
    `segment_ids` [b, S] (packed sequences; None = each row is one sequence). With `kernel` (flash-attn's varlen
    signature) the rows/segments become cu_seqlens and no [S, S] mask exists; else sdpa with a block-diagonal
    causal mask (CPU). `window`: a key more than window - 1 tokens before the query is not attended (HF's sliding
    window); `softcap`: scores become softcap * tanh(scores / softcap) before the softmax (flash-attn has both; on
    CPU soft-capping runs as plain matmuls, which sdpa cannot). On CPU, bf16 inputs (or autocast) run in fp32."""
    batch, heads, length, dim = q.shape
    if kernel is not None:
        segments = segment_ids if segment_ids is not None else torch.arange(batch, device=q.device)[:, None].expand(
            batch, length)
        if segment_ids is not None:  # segments of different rows never merge
            segments = segments + torch.arange(batch, device=q.device)[:, None] * (int(segments.max()) + 2)
        bounds, longest = cu_seqlens(segments)

        value_dim = v.shape[-1]
        if value_dim != dim:  # MLA (DeepSeek): flash-attn wants one head dim, so v is padded and the output cut
            v = F.pad(v, [0, dim - value_dim])

        def flat(x):
            return x.transpose(1, 2).reshape(batch * length, x.shape[1], dim)

        out = kernel(flat(q), flat(k), flat(v), bounds, bounds, longest, longest, dropout_p=dropout,
                     softmax_scale=scale, causal=True, window_size=(window - 1, 0) if window else (-1, -1),
                     softcap=float(softcap or 0.0))
        return out.reshape(batch, length, heads, dim)[..., :value_dim].transpose(1, 2)
    if q.device.type == "cpu" and (q.dtype in LOW_PRECISION or torch.is_autocast_enabled("cpu")):
        # torch's CPU attention is slower in bf16 than in fp32 at these shapes (learner/precision.py)
        return in_fp32(lambda *qkv: inner_attention(*qkv, segment_ids, scale, dropout, window=window, softcap=softcap),
                       q, k, v)
    if k.shape[1] != heads:  # grouped-query attention: heads stay grouped within each rank's slice
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    if segment_ids is None and not window and not softcap:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale)
    index = torch.arange(length, device=q.device)
    mask = (index[:, None] >= index[None, :])[None]  # [1, S, S] causal
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])  # [b, S, S]
    if window:  # within a row or a packed sequence, positions are consecutive: index distance is position distance
        mask = mask & ((index[:, None] - index[None, :]) < window)[None]
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else dim ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)
