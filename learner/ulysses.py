"""Ulysses sequence parallelism: each rank of an SP group holds a contiguous slice of the sequence, and attention
swaps that for a slice of the heads with one all-to-all before and one after (DeepSpeed-Ulysses).

It is our own all-to-all (`all_to_all_single` in an autograd Function) rather than DeepSpeed's
`DistributedAttention`: that needs `deepspeed.comm` initialised beside torch.distributed and JIT-compiles a
shared-memory op on first use (24 s on CPU), for the same two collectives. Both are bit-exact on gloo.

The function is plugged into HF models with `transformers.AttentionInterface.register` under ATTN_NAME and
selected per model (`set_attn_implementation`), never by patching a module. Every rank passes its *global*
position ids, so rotary embeddings see the true positions. Masking happens on the full sequence after the first
all-to-all: plain causal for right-padded rows (padding sits after every real token, so no real token sees it), and
block-diagonal causal when `segment_ids` (global, [b, S]) says where packed sequences start and end.
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


class _SeqToHeads(torch.autograd.Function):
    """[b, h, s_local, d] -> [b, h/sp, S, d]; its gradient takes the inverse trip."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group, scatter_dim=1, gather_dim=2)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, scatter_dim=2, gather_dim=1), None


class _HeadsToSeq(torch.autograd.Function):
    """[b, h/sp, S, d] -> [b, h, s_local, d]."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group, scatter_dim=2, gather_dim=1)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, scatter_dim=1, gather_dim=2), None


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
                      segment_ids=None, sp_group=None, kv_repeat: int = 1, **kwargs):
    """HF attention function. query [b, h, s, d], key/value [b, kv, s, d] (local sequence slice); returns
    ([b, s, h, d], None) like HF's sdpa function."""
    if kv_repeat > 1:
        key = key.repeat_interleave(kv_repeat, dim=1)
        value = value.repeat_interleave(kv_repeat, dim=1)
    q = _SeqToHeads.apply(query, sp_group)  # [b, h/sp, S, d]
    k = _SeqToHeads.apply(key, sp_group)
    v = _SeqToHeads.apply(value, sp_group)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: heads stay grouped within each rank's slice
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if segment_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling)
    else:
        length = q.shape[2]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal  # [b, S, S]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout, scale=scaling)
    out = _HeadsToSeq.apply(out, sp_group)  # [b, h, s, d]
    return out.transpose(1, 2).contiguous(), None


def apply_ulysses(model, sp_group, sp_size: int) -> None:
    """Route `model`'s attention through Ulysses over `sp_group`. Models must not share a config object (two
    models built from one config share it in transformers 5, and this would flip both): load_model builds each
    model's own."""
    import functools

    from transformers import AttentionInterface

    kv_repeat = check_heads(model.config, sp_size)
    AttentionInterface.register(ATTN_NAME, functools.partial(ulysses_attention, sp_group=sp_group,
                                                             kv_repeat=kv_repeat))
    model.set_attn_implementation(ATTN_NAME)
