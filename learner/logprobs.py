"""Token logprobs and entropy at the sampling temperature, computed in chunks, padded or packed, on one rank or
split over a sequence-parallel group.

The decoder runs once; the LM head is applied to `chunk_tokens` positions at a time, so the [B, T, V] fp32 logits
never exist at once. Logits are divided by each row's sampling temperature before the softmax, because the
generator's logprobs describe the distribution it actually sampled from (vLLM `processed_logprobs`); for the same
reason a row sampled with top-k or top-p gets its logprobs over that nucleus, renormalised (learner/nucleus.py).

Whatever the layout, the decoder sees a *stream*: rows of token ids with their position ids, each position's
target (the next token) and temperature. Padded, the stream is the batch itself. Packed, it is one row holding every
sequence back to back, positions restarting at 0 per sequence and attention kept inside each one (block-diagonal
mask on CPU sdpa; on GPUs flash-attn varlen reads the same restarting positions). Under Ulysses each SP rank runs
its contiguous slice of the stream's columns, computes logprobs for its positions only, and the [rows, S] logprobs
are gathered (differentiably) so every SP rank holds the whole sequence's values for the loss.
"""
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from asyncrl.data.vision import is_vision, placeholder_tokens, rope_positions, suppress, text_config
from asyncrl.learner.liger_head import liger_logprobs
from asyncrl.learner.nucleus import needs_nucleus, nucleus_removed
from asyncrl.learner.ulysses import gather_sequence


@dataclass
class Stream:
    ids: torch.Tensor  # [R, S] int64
    positions: torch.Tensor  # [R, S] int64
    targets: torch.Tensor  # [R, S] int64: the token that position predicts (0 where none)
    temps: torch.Tensor  # [R, S] float: sampling temperature of the position's sequence
    top_ks: Optional[torch.Tensor]  # [R, S] int64: the sequence's top-k (-1 off), None when no row uses one
    top_ps: Optional[torch.Tensor]  # [R, S] float: the sequence's top-p (1 off), None when no row uses one
    segments: Optional[torch.Tensor]  # [R, S] int64 sequence index per position (packed only)
    attention_mask: Optional[torch.Tensor]  # [R, S] 0/1 (padded only)
    inputs: Optional[dict] = None  # the forward's other inputs: a vision-language model's pixels and grids


def compute_logprobs(
    model,
    input_ids: torch.Tensor,  # [B, L] int64, right-padded
    attention_mask: torch.Tensor,  # [B, L] 0/1
    temperatures: torch.Tensor,  # [B] float
    chunk_tokens: int,
    with_entropy: bool = False,
    packed: bool = False,
    sp_group=None,
    top_ks: Optional[torch.Tensor] = None,  # [B] int64, -1 off
    top_ps: Optional[torch.Tensor] = None,  # [B] float, 1 off
    fp32_head: bool = False,  # the LM head's matmul in fp32 (model.lm_head_fp32)
    liger: bool = False,  # the head through liger-kernel's fused linear + cross-entropy (learner.liger)
    vision=None,  # data/vision.py's VisionInputs of the rows' images, in row order (None: no row has images)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of token t+1 given tokens <= t, shape [B, L-1] (fp32); and the entropy of that distribution (over
    the row's top-k / top-p nucleus when it has one)."""
    nucleus = {"top_ks": top_ks, "top_ps": top_ps} if top_ks is not None or top_ps is not None else {}
    stream = packed_stream(input_ids, attention_mask, temperatures, **nucleus) if packed else padded_stream(
        input_ids, attention_mask, temperatures, **nucleus)
    if is_vision(model.config):
        stream = vision_stream(model, stream, input_ids, attention_mask, vision)
    sp_size = dist.get_world_size(sp_group) if sp_group is not None else 1
    if sp_size > 1:
        stream = pad_columns(stream, sp_size)
        rank, width = dist.get_rank(sp_group), stream.ids.shape[1] // sp_size
        local = slice(rank * width, (rank + 1) * width)
        hidden = decoder_states(model, input_ids=stream.ids[:, local], position_ids=stream.positions[:, local],
                                segment_ids=stream.segments)  # [R, s, H]
        logprobs, entropy = head_logprobs(model, hidden, stream.targets[:, local], stream.temps[:, local],
                                          chunk_tokens, with_entropy, *local_nucleus(stream, local),
                                          fp32_head=fp32_head, liger=liger)
        logprobs = gather_sequence(logprobs, sp_group)  # [R, S]
        entropy = gather_sequence(entropy, sp_group) if with_entropy else None
    else:
        hidden = run_decoder(model, stream)  # [R, S, H]
        logprobs, entropy = head_logprobs(model, hidden, stream.targets, stream.temps, chunk_tokens, with_entropy,
                                          stream.top_ks, stream.top_ps, fp32_head=fp32_head, liger=liger)
    unstream = unpack if packed else unpad
    return unstream(logprobs, attention_mask), unstream(entropy, attention_mask) if with_entropy else None


def per_position(values: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    """A per-row [B] setting as [B, L], one value per position of the row (None stays None)."""
    return None if values is None else values[:, None].expand_as(like)


def padded_stream(input_ids, attention_mask, temperatures, top_ks=None, top_ps=None) -> Stream:
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    return Stream(ids=input_ids, positions=(attention_mask.long().cumsum(-1) - 1).clamp(min=0), targets=targets,
                  temps=per_position(temperatures, input_ids), top_ks=per_position(top_ks, input_ids),
                  top_ps=per_position(top_ps, input_ids), segments=None, attention_mask=attention_mask)


def packed_stream(input_ids, attention_mask, temperatures, top_ks=None, top_ps=None) -> Stream:
    """Right-padded rows as ONE row without padding: positions restart per sequence, segments say which is which."""
    valid = attention_mask.bool()  # [B, L], a prefix of each row
    lengths = valid.sum(-1)  # [B]
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    positions = torch.arange(valid.shape[1]).expand_as(input_ids)

    def flat(values):
        return None if values is None else per_position(values, input_ids)[valid][None]

    return Stream(ids=input_ids[valid][None], positions=positions[valid][None], targets=targets[valid][None],
                  temps=flat(temperatures), top_ks=flat(top_ks), top_ps=flat(top_ps),
                  segments=torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None], attention_mask=None)


def vision_stream(model, stream: Stream, input_ids, attention_mask, vision) -> Stream:
    """A vision-language model's stream: M-RoPE positions from the model's own `get_rope_index` ([3, B, L]
    padded; packed, [4, 1, N] whose first row is the restarting text positions the model reads sequence boundaries
    from) and the rows' pixels and grids. Under Ulysses the columns would split an image's patches over ranks:
    build_policy refuses sequence parallelism for these models."""
    mrope = rope_positions(model, input_ids, attention_mask, None if vision is None else vision.image_grid_thw)
    if stream.segments is None:
        positions = mrope
    else:
        valid = attention_mask.bool()
        positions = torch.cat([stream.positions[None], mrope[:, valid][:, None]])
    inputs = {} if vision is None else {"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}
    return replace(stream, positions=positions, inputs=inputs)


def local_nucleus(stream: Stream, local: slice) -> tuple:
    """This SP rank's columns of the stream's top-k and top-p (None where the stream has none)."""
    return tuple(None if values is None else values[:, local] for values in (stream.top_ks, stream.top_ps))


def pad_columns(stream: Stream, multiple: int) -> Stream:
    """Extra columns so the stream splits evenly over SP ranks. Padding positions continue the last row's count and
    form their own segment; their outputs are cut off before anything reads them."""
    width = stream.ids.shape[1]
    extra = -width % multiple
    if not extra:
        return stream

    def grow(tensor, fill):
        if tensor is None:
            return None
        return torch.cat([tensor, tensor.new_full((tensor.shape[0], extra), fill)], dim=1)

    positions = torch.cat([stream.positions, stream.positions[:, -1:] + torch.arange(1, extra + 1)], dim=1)
    segments = grow(stream.segments, -1)
    return Stream(ids=grow(stream.ids, 0), positions=positions, targets=grow(stream.targets, 0),
                  temps=grow(stream.temps, 1.0), top_ks=grow(stream.top_ks, -1), top_ps=grow(stream.top_ps, 1.0),
                  segments=segments, attention_mask=grow(stream.attention_mask, 0))


def run_decoder(model, stream: Stream, forward=None) -> torch.Tensor:
    """Decoder states [R, S, H] on one rank: the padding mask, or for packed rows the block-diagonal causal mask
    (sdpa), or nothing but the restarting position ids (flash-attn 2, which reads them as varlen boundaries).
    `forward(model, **inputs)` is what is read off the model (default `decoder_states`; the critic's values,
    learner/critic.py)."""
    forward = forward or decoder_states
    extra = stream.inputs or {}
    if stream.segments is not None and model.config._attn_implementation.startswith("flash_attention"):
        return forward(model, input_ids=stream.ids, position_ids=stream.positions, **extra)
    if stream.segments is None:
        return forward(model, input_ids=stream.ids, attention_mask=stream.attention_mask,
                       position_ids=stream.positions, **extra)
    count = stream.ids.shape[1]
    causal = torch.ones(count, count, dtype=torch.bool).tril()
    block = (stream.segments[:, :, None] == stream.segments[:, None, :]) & causal  # [R, S, S]
    masks = packed_masks(text_config(model.config), block[:, None])
    if model.config._attn_implementation == "eager":  # eager adds the mask to the scores: it must be additive
        dtype = model.get_input_embeddings().weight.dtype
        masks = ({kind: additive(mask, dtype) for kind, mask in masks.items()} if isinstance(masks, dict)
                 else additive(masks, dtype))
    return forward(model, input_ids=stream.ids, attention_mask=masks, position_ids=stream.positions, **extra)


def additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean keep-mask as the additive mask eager attention expects: 0 where kept, the dtype's min elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def packed_masks(config, block: torch.Tensor):
    """The packed stream's mask as the model's layers need it. A 4D mask passed to an HF model is used as given,
    so the sliding window some layers apply (Mistral: every layer; Gemma 2: every other one, `layer_types`) must be
    in it, or those layers would silently see the whole sequence. Models with `layer_types` take one mask per
    type; others one mask for every layer. `block` [R, 1, S, S] bool, causal within each packed sequence."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        masks = {"full_attention": block}
        if "sliding_attention" in layer_types:
            masks["sliding_attention"] = block & band(block.shape[-1], window, block.device)
        return masks
    if window:  # no layer types: the window, when set, applies to every layer (Mistral, Mixtral)
        return block & band(block.shape[-1], window, block.device)
    return block


def band(count: int, window: int, device) -> torch.Tensor:
    """[S, S]: key j is within `window` tokens of query i (i - j < window), HF's sliding-window convention. Inside
    one packed sequence positions are consecutive, so the index difference is the position difference."""
    index = torch.arange(count, device=device)
    return (index[:, None] - index[None, :]) < window


NO_LOGITS = torch.zeros(0, dtype=torch.long)


def decoder_states(model, **inputs) -> torch.Tensor:
    """The final (normed) decoder states [R, S, H], through the model's own forward with logits for no position.

    Going through the root module's forward, rather than calling its decoder directly, matters under FSDP2: the
    root's hooks gather the embeddings and final norm (and the head tied to them) and arrange their gradient
    reduction. The LM head is then applied in chunks by the caller.
    """
    out = model(**inputs, output_hidden_states=True, logits_to_keep=NO_LOGITS, use_cache=False)
    return out.hidden_states[-1]


def head_logprobs(model, hidden, targets, temps, chunk_tokens: int, with_entropy: bool, top_ks=None, top_ps=None,
                  fp32_head: bool = False, liger: bool = False):
    """[R, S] logprobs of `targets` (and entropies), applying the LM head `chunk_tokens` positions at a time.
    `with_entropy`: False, True (detached: a metric), or "grad" (with its gradient: algo.entropy_coef's bonus,
    computed from the same recomputed chunk logits as the logprobs). `liger`: the logprobs from liger-kernel's fused
    linear + cross-entropy (learner/liger_head.py), the entropy metric from a no-grad pass of the plain head."""
    if liger:
        return liger_head_logprobs(model, hidden, targets, temps, chunk_tokens, with_entropy, top_ks, top_ps,
                                   fp32_head)
    head = model.get_output_embeddings()
    if fp32_head:
        head = Fp32Head(head)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:  # Gemma 2: the model's logits are softcap * tanh(logits / softcap), before any temperature
        head = SoftcappedHead(head, float(softcap))
    if is_vision(model.config):  # the placeholders the engines never sample (data/vision.py)
        head = SuppressedHead(head, placeholder_tokens(model.config))
    rows, length, width = hidden.shape
    flat_hidden = hidden.reshape(-1, width)
    flat_targets = targets.reshape(-1)
    flat_temps = temps.reshape(-1).to(torch.promote_types(hidden.dtype, torch.float32))
    flat_ks = None if top_ks is None else top_ks.reshape(-1)
    flat_ps = None if top_ps is None else top_ps.reshape(-1)
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        nucleus = (None if flat_ks is None else flat_ks[start:stop], None if flat_ps is None else flat_ps[start:stop])
        args = (head, flat_hidden[start:stop], flat_targets[start:stop], flat_temps[start:stop], *nucleus)
        if with_entropy == "grad" and torch.is_grad_enabled():
            logprobs_chunk, entropy_chunk = checkpoint(_chunk_logprobs_entropy, *args, use_reentrant=False)
        elif torch.is_grad_enabled():
            # Recompute the chunk's logits in backward instead of keeping [chunk, V] fp32 alive for every chunk.
            logprobs_chunk, entropy_chunk = checkpoint(_chunk_logprobs, *args, bool(with_entropy), use_reentrant=False)
        else:
            logprobs_chunk, entropy_chunk = _chunk_logprobs(*args, bool(with_entropy))
        logprob_chunks.append(logprobs_chunk)
        entropy_chunks.append(entropy_chunk)
    logprobs = torch.cat(logprob_chunks).view(rows, length)
    entropy = torch.cat(entropy_chunks).view(rows, length) if with_entropy else None
    return logprobs, entropy


def liger_head_logprobs(model, hidden, targets, temps, chunk_tokens: int, with_entropy, top_ks, top_ps,
                        fp32_head: bool):
    """head_logprobs through liger-kernel: what it cannot compute is refused, not approximated."""
    if top_ks is not None or top_ps is not None:
        raise ValueError("learner.liger computes the full softmax's logprobs; these rows were sampled from a top-k / "
                         "top-p nucleus (rollout.top_k, rollout.top_p): turn learner.liger off")
    if with_entropy == "grad":
        raise ValueError("learner.liger does not give the entropy's gradient (algo.entropy_coef > 0)")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("learner.liger cannot apply the model's final-logit soft-capping before the temperature")
    rows, length, width = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(-1, width), targets.reshape(-1)
    flat_temps = temps.reshape(-1).to(torch.promote_types(hidden.dtype, torch.float32))
    head = model.get_output_embeddings()
    if fp32_head:
        flat_hidden = flat_hidden.float()
    logprobs = liger_logprobs(head, flat_hidden, flat_targets, flat_temps).view(rows, length)
    if not with_entropy:
        return logprobs, None
    plain = Fp32Head(head) if fp32_head else head
    with torch.no_grad():
        entropy = torch.cat([_chunk_logprobs(plain, flat_hidden[start:start + chunk_tokens].detach(),
                                             flat_targets[start:start + chunk_tokens],
                                             flat_temps[start:start + chunk_tokens], with_entropy=True)[1]
                             for start in range(0, flat_hidden.shape[0], chunk_tokens)])
    return logprobs, entropy.view(rows, length)


def unpad(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S>=L] stream values -> [B, L-1] (position t predicts token t+1)."""
    return values[:, : attention_mask.shape[1] - 1]


def unpack(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[1, S>=N] packed values -> [B, L-1]: each sequence's positions but its last (which predicts nothing)."""
    valid = attention_mask.bool()
    lengths = valid.sum(-1)
    predicts = valid.clone()
    predicts[torch.arange(len(lengths)), (lengths - 1).clamp(min=0)] = False  # the last token of each sequence
    flat = values[0, : int(lengths.sum())][predicts[valid]]
    out = values.new_zeros(attention_mask.shape[0], attention_mask.shape[1] - 1)
    return out.masked_scatter(valid[:, 1:], flat)


class Fp32Head:
    """The LM head's matmul in fp32 (at least), under learner.autocast too: bf16 hidden states and weights are upcast
    before it, so the logits carry no bf16 rounding. The weight is read while the root's forward has it unsharded
    (FSDP2), as the plain head call does."""

    def __init__(self, head):
        self.head = head

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        bias = self.head.bias
        with torch.autocast(hidden.device.type, enabled=False):  # learner.autocast would take it back to bf16
            return torch.nn.functional.linear(hidden.to(dtype), self.head.weight.to(dtype),
                                              None if bias is None else bias.to(dtype))


class SoftcappedHead:
    """The LM head followed by the final logit soft-capping some families apply (Gemma 2's
    `final_logit_softcapping`), as the model's own forward and vLLM do."""

    def __init__(self, head, softcap: float):
        self.head, self.softcap = head, softcap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _at_least_fp32(self.head(hidden))
        return torch.tanh(logits / self.softcap) * self.softcap


class SuppressedHead:
    """The LM head with a vision-language model's placeholder tokens held at SUPPRESSED_LOGIT, as its engines
    sample (data/vision.py::suppress)."""

    def __init__(self, head, token_ids: tuple):
        self.head, self.token_ids = head, token_ids

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return suppress(_at_least_fp32(self.head(hidden)), self.token_ids)


def _chunk_logits(head, hidden, targets, temps, top_ks, top_ps):
    """[chunk, V] tempered logits, -inf outside each position's nucleus when it has one."""
    logits = _at_least_fp32(head(hidden)) / temps[:, None]  # [chunk, V]
    if needs_nucleus(top_ks, top_ps, logits.shape[-1]):
        count = logits.shape[0]
        ks = top_ks if top_ks is not None else torch.full((count,), -1, dtype=torch.long, device=logits.device)
        ps = top_ps if top_ps is not None else torch.ones(count, dtype=logits.dtype, device=logits.device)
        logits = logits.masked_fill(nucleus_removed(logits.detach(), ks, ps, targets), float("-inf"))
    return logits


def _chunk_logprobs(head, hidden, targets, temps, top_ks=None, top_ps=None, with_entropy: bool = False):
    """The chunk's logprobs [chunk] and, `with_entropy`, its entropy [chunk] as a detached metric (else None).
    Both come from ONE head matmul and softmax: a separate entropy pass would cost a second head matmul per chunk
    (the vocabulary-wide one, the largest of a small model's step). Under `checkpoint` the no-grad entropy is
    recomputed with the logits in backward: a few elementwise passes, not a matmul."""
    log_probs = _chunk_logits(head, hidden, targets, temps, top_ks, top_ps).log_softmax(-1)
    logprobs = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        return logprobs, _entropy(log_probs)


def _chunk_logprobs_entropy(head, hidden, targets, temps, top_ks=None, top_ps=None):
    """Both from one softmax of the chunk's logits, both with grad."""
    log_probs = _chunk_logits(head, hidden, targets, temps, top_ks, top_ps).log_softmax(-1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1), _entropy(log_probs)


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    # tokens outside the nucleus have probability 0 and contribute nothing (0 * -inf would be nan, in the value
    # and in the gradient: hence where() on both factors)
    finite = log_probs.isfinite()
    safe = torch.where(finite, log_probs, 0.0)
    return -torch.where(finite, safe.exp() * safe, 0.0).sum(-1)


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """bf16 logits are upcast (logsumexp in bf16 is unstable); fp64 stays fp64 for exact tests."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))
