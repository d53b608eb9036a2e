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
attention (learner/sequence_attention.py) is flash-attn's varlen kernel on CUDA and sdpa on CPU.
"""
import torch
import torch.distributed as dist

from asyncrl.learner.sequence_attention import inner_attention, varlen_kernel

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
