"""Ulysses sequence parallelism: each rank of an SP group holds a contiguous slice of the sequence, and attention
swaps that for a slice of the heads with one all-to-all before and one after (DeepSpeed-Ulysses).

By default (`learner.sp_impl=native`) it is our own all-to-all (`all_to_all_single` in an autograd Function);
`learner.sp_impl=deepspeed` hands the two all-to-alls to DeepSpeed's `DistributedAttention`
(learner/ulysses_deepspeed.py), around the same inner attention. Native is the default because DeepSpeed needs
`deepspeed.comm` initialised beside torch.distributed and compiles a shared-memory op on first use (about 40 s on
CPU) for the same two collectives; both are bit-exact on gloo.

The function is plugged into HF models with `transformers.AttentionInterface.register` under ATTN_NAME and
selected per model (`set_attn_implementation`), never by patching a module. Every rank passes its *global*
position ids, so rotary embeddings see the true positions. Masking happens on the full sequence after the first
all-to-all: plain causal for right-padded rows (padding sits after every real token, so no real token sees it), and
block-diagonal causal when `segment_ids` (global, [b, S]) says where packed sequences start and end. The inner
attention is flash-attn's varlen kernel on CUDA (cu_seqlens from the segments, no mask) and sdpa on CPU.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTN_NAME = "asyncrl_ulysses"


class UlyssesConfigError(ValueError):
    """The model's head counts do not fit the sequence-parallel size."""


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into SP chunks along scatter_dim, send chunk i to rank i, and concatenate what arrives (in rank
    order) along gather_dim."""
    world = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
    send = torch.stack(chunks)  # [sp, ...]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` with its gradient taking the inverse trip (scatter and gather dims swapped). Sequence to heads:
    [b, h, s_local, d] -> [b, h/sp, S, d] is (scatter 1, gather 2); heads to sequence is (2, 1)."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s_local, d] -> [b, h/sp, S, d]."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h/sp, S, d] -> [b, h, s_local, d]."""
    return _AllToAll.apply(x, group, 2, 1)


class _GatherSeq(torch.autograd.Function):
    """All-gather [b, s_local] slices into [b, S]. Every SP rank then computes the same loss on the whole sequence,
    so the gradient of the whole is identical on each rank and each keeps only its own slice (no double count)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.width = x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.width
        return grad[:, start:start + ctx.width].contiguous(), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s_local] on each SP rank -> [b, S], differentiable."""
    return _GatherSeq.apply(x, group)


def check_heads(config, sp_size: int) -> int:
    """How many times to repeat the KV heads before the all-to-all (1 = none); a clear error if SP cannot work."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % sp_size:
        raise UlyssesConfigError(
            f"learner.sp_size={sp_size} does not divide the model's {heads} attention heads; Ulysses gives each SP "
            f"rank heads/sp_size heads. Use an sp_size that divides {heads}.")
    if kv_heads % sp_size == 0:
        return 1
    return heads // kv_heads  # repeat KV up to one per query head, which sp_size divides


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      segment_ids=None, sp_group=None, kv_repeat: int = 1, sliding_window=None, softcap=None,
                      exchange=None, **kwargs):
    """HF attention function. query [b, h, s, d], key/value [b, kv, s, d] (local sequence slice); returns
    ([b, s, h, d], None) like HF's sdpa function. `sliding_window` and `softcap` are what the layer passes (Mistral's
    and Gemma 2's window, Gemma 2's attention logit soft-capping), honoured on the full sequence. `exchange`:
    DeepSpeed's `DistributedAttention` (learner/ulysses_deepspeed.py) instead of our all-to-all."""
    if kv_repeat > 1:
        key = key.repeat_interleave(kv_repeat, dim=1)
        value = value.repeat_interleave(kv_repeat, dim=1)
    if exchange is not None:
        out = exchange(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0,
                       segment_ids=segment_ids, scale=scaling, dropout=dropout, window=sliding_window,
                       softcap=softcap)
        return out.contiguous(), None
    q = seq_to_heads(query, sp_group)  # [b, h/sp, S, d]
    k = seq_to_heads(key, sp_group)
    v = seq_to_heads(value, sp_group)
    out = inner_attention(q, k, v, segment_ids, scaling, dropout, varlen_kernel(q.device), window=sliding_window,
                          softcap=softcap)
    out = heads_to_seq(out, sp_group)  # [b, h, s, d]
    return out.transpose(1, 2).contiguous(), None


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
    """Causal attention over the full sequence: q [b, h, S, d], k/v [b, h_kv, S, d] -> [b, h, S, d].
    `segment_ids` [b, S] (packed sequences; None = each row is one sequence). With `kernel` (flash-attn's varlen
    signature) the rows/segments become cu_seqlens and no [S, S] mask exists; else sdpa with a block-diagonal
    causal mask (CPU). `window`: a key more than window - 1 tokens before the query is not attended (HF's sliding
    window); `softcap`: scores become softcap * tanh(scores / softcap) before the softmax (flash-attn has both; on
    CPU soft-capping runs as plain matmuls, which sdpa cannot)."""
    batch, heads, length, dim = q.shape
    if kernel is not None:
        segments = segment_ids if segment_ids is not None else torch.arange(batch, device=q.device)[:, None].expand(
            batch, length)
        if segment_ids is not None:  # segments of different rows never merge
            segments = segments + torch.arange(batch, device=q.device)[:, None] * (int(segments.max()) + 2)
        bounds, longest = cu_seqlens(segments)

        def flat(x):
            return x.transpose(1, 2).reshape(batch * length, x.shape[1], dim)

        out = kernel(flat(q), flat(k), flat(v), bounds, bounds, longest, longest, dropout_p=dropout,
                     softmax_scale=scale, causal=True, window_size=(window - 1, 0) if window else (-1, -1),
                     softcap=float(softcap or 0.0))
        return out.reshape(batch, length, heads, dim).transpose(1, 2)
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


def apply_ulysses(model, sp_group, sp_size: int, impl: str = "native"):
    """Route `model`'s attention through Ulysses over `sp_group`, with our all-to-all (`impl="native"`) or
    DeepSpeed's (`"deepspeed"`); returns the attention function registered. Models must not share a config object
    (two models built from one config share it in transformers 5, and this would flip both): load_model builds each
    model's own."""
    import functools

    from transformers import AttentionInterface

    kv_repeat = check_heads(model.config, sp_size)
    if impl == "native":
        exchange = None
    elif impl == "deepspeed":
        from asyncrl.learner.ulysses_deepspeed import deepspeed_exchange

        exchange = deepspeed_exchange(sp_group)
    else:
        raise ValueError(f"learner.sp_impl must be native or deepspeed, got {impl!r}")
    attention = functools.partial(ulysses_attention, sp_group=sp_group, kv_repeat=kv_repeat, exchange=exchange)
    AttentionInterface.register(ATTN_NAME, attention)
    model.set_attn_implementation(ATTN_NAME)
    return attention
