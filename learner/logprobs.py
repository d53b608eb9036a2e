"""Token logprobs and entropy at the sampling temperature, computed in chunks.

The decoder runs once; the LM head is applied to `chunk_tokens` positions at a time, so the [B, T, V] fp32 logits
never exist at once. Logits are divided by each row's sampling temperature before the softmax, because the
generator's logprobs describe the distribution it actually sampled from (vLLM `processed_logprobs`).
"""
import torch
from torch.utils.checkpoint import checkpoint


def compute_logprobs(
    model,
    input_ids: torch.Tensor,  # [B, L] int64, right-padded
    attention_mask: torch.Tensor,  # [B, L] 0/1
    temperatures: torch.Tensor,  # [B] float
    chunk_tokens: int,
    with_entropy: bool = False,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of token t+1 given tokens <= t, shape [B, L-1] (fp32); and the entropy of that distribution."""
    if packed:
        hidden = packed_hidden_states(model, input_ids, attention_mask)  # [B, L, H]
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state  # [B, L, H]
    head = model.get_output_embeddings()
    hidden = hidden[:, :-1]  # [B, L-1, H]
    targets = input_ids[:, 1:]  # [B, L-1]
    batch, length, width = hidden.shape
    flat_hidden = hidden.reshape(-1, width)
    flat_targets = targets.reshape(-1)
    flat_temps = temperatures.to(torch.promote_types(hidden.dtype, torch.float32)).repeat_interleave(length)
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        args = (head, flat_hidden[start:stop], flat_targets[start:stop], flat_temps[start:stop])
        if torch.is_grad_enabled():
            # Recompute the chunk's logits in backward instead of keeping [chunk, V] fp32 alive for every chunk.
            logprob_chunks.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            logprob_chunks.append(_chunk_logprobs(*args))
        if with_entropy:
            with torch.no_grad():
                entropy_chunks.append(_chunk_entropy(head, flat_hidden[start:stop].detach(), flat_temps[start:stop]))
    logprobs = torch.cat(logprob_chunks).view(batch, length)
    entropy = torch.cat(entropy_chunks).view(batch, length) if with_entropy else None
    return logprobs, entropy


def packed_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Decoder states of right-padded rows computed as ONE packed row without padding, put back as [B, L, H].

    Positions restart at 0 for each sequence and a block-diagonal causal mask keeps attention inside it, so the
    result equals the padded pass while the decoder never computes a padding token. The [N, N] boolean mask
    suits sdpa on CPU; on GPUs flash-attn's varlen kernel makes the mask unnecessary (learner-at-scale issue).
    """
    valid = attention_mask.bool()  # [B, L], a prefix of each row
    lengths = valid.sum(-1)  # [B]
    flat_ids = input_ids[valid][None]  # [1, N]: rows one after another
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [N]
    positions = torch.arange(valid.shape[1]).expand_as(input_ids)[valid][None]  # [1, N], restart per row
    count = flat_ids.shape[1]
    causal = torch.ones(count, count, dtype=torch.bool).tril()
    block = (segment[:, None] == segment[None, :]) & causal  # [N, N]
    flat = model.get_decoder()(input_ids=flat_ids, attention_mask=block[None, None],
                               position_ids=positions).last_hidden_state[0]  # [N, H]
    hidden = flat.new_zeros(*input_ids.shape, flat.shape[-1])  # [B, L, H]
    hidden[valid] = flat
    return hidden


def _chunk_logprobs(head, hidden, targets, temps):
    logits = _at_least_fp32(head(hidden)) / temps[:, None]  # [chunk, V]
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def _chunk_entropy(head, hidden, temps):
    log_probs = (_at_least_fp32(head(hidden)) / temps[:, None]).log_softmax(-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """bf16 logits are upcast (logsumexp in bf16 is unstable); fp64 stays fp64 for exact tests."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))
