"""Policy losses and their aggregation over tokens (reference/offpolicy_algorithms.md §1.1, §1.15, §2.2).

A policy loss is a pure function: [B, T] tensors in, ``(per_token_loss [B, T], metrics)`` out. It does NOT
reduce over tokens, because the right normaliser is a property of the whole optimizer step (all micro-batches
on all ranks), which one call cannot see. ``aggregate_loss`` does the reduction with global counts, so that
summing it over micro-batches gives exactly the full-batch loss, whatever the micro-batch composition.

Inputs, all [B, T] and aligned on generated tokens:
- ``logprobs``       ℓθ, current learner pass; the only input that receives gradient.
- ``logprobs_prox``  ℓprox, no-grad learner pass at the start of the step (the trust-region centre).
- ``advantages``     A, already broadcast per token.
- ``loss_mask``      1 on generated tokens that train, 0 elsewhere (prompt, tool output, padding).
- ``is_weight``      optional w = π_prox/π_behav from ``corrections.compute_is_weight``: detached, truncated or
                     masked, 0 off-mask. Rejected tokens (w = 0) stay in ``loss_mask``, so the normaliser keeps the
                     original token count (AReaL/slime; masking must not inflate the kept tokens' gradient).
Masked positions may hold anything (-inf logprobs, NaN advantages): they are replaced before any arithmetic, so
neither the loss nor the gradient can pick up a NaN from them.

Metric convention (shared with ``corrections.py``; ``metrics.combine_token_metrics`` implements it):
- ``<area>/<name>``      mean over this call's valid tokens (handy for a single micro-batch);
- ``<area>/<name>_sum``  the same quantity summed over this call's valid tokens;
- ``<area>/tokens``      this call's valid-token count;
- ``<area>/.../max``     a max over this call's valid tokens.
To combine micro-batches or ranks: add every ``_sum`` and ``tokens`` (all-reduce SUM), take the max of every
``/max`` (all-reduce MAX), then ``<area>/<name> = <area>/<name>_sum / max(<area>/tokens, 1)``. Metric values are
detached 0-d tensors, so collecting them never forces a device sync.
"""
import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""|log ratio| is clamped to this before exp (verl, OpenRLHF): e^20 is large but finite in fp32 and bf16."""


def _masked_log_ratio(logprobs: Tensor, logprobs_ref: Tensor, valid: Tensor) -> Tensor:
    # fp32 at least: bf16 log-prob differences lose most of their digits (pitfall §4.5).
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    diff = logprobs.to(dtype) - logprobs_ref.to(dtype)
    # where(), not *mask: -inf - -inf = NaN at padding would otherwise leak into exp() and its backward.
    diff = torch.where(valid, diff, torch.zeros_like(diff))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _token_metric(metrics: dict, name: str, per_token: Tensor, valid: Tensor, tokens: Tensor) -> None:
    total = torch.where(valid, per_token.to(tokens.dtype), torch.zeros_like(tokens)).sum()
    metrics[f"{name}_sum"] = total
    metrics[name] = total / tokens.clamp(min=1.0)


def ppo_clip_loss(
    logprobs: Tensor,
    logprobs_prox: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    is_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip centred on π_prox; the decoupled PPO objective (AReaL) when ``is_weight`` is given.

    L_t = w_t * max(-u_t A_t, -clip(u_t, 1 - clip_low, 1 + clip_high) A_t),  u_t = exp(ℓθ_t - ℓprox_t).
    Dual clip (Ye et al. 2019) caps the loss of A < 0 tokens at -c A, so one token whose ratio exploded cannot
    dominate the step. Clipping is centred on π_prox rather than the stale behaviour policy because a trust
    region around μ is the "improper clipping centre" that makes naive async PPO diverge (§2.2).
    Returns the per-token loss [B, T] (0 where ``loss_mask`` is 0) and the metrics described in the module doc.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}/{clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    valid = loss_mask.bool()  # [B, T]
    log_ratio = _masked_log_ratio(logprobs, logprobs_prox.detach(), valid)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T], u = π_θ / π_prox
    zeros = torch.zeros_like(ratio)
    adv = torch.where(valid, advantages.detach().to(ratio.dtype), zeros)  # [B, T]

    loss_unclipped = -ratio * adv
    loss_clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
    is_dual_clipped = torch.zeros_like(valid)
    if dual_clip_c is not None:
        cap = -dual_clip_c * adv  # [B, T], positive where A < 0
        is_dual_clipped = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    if is_weight is not None:
        loss = torch.where(valid, is_weight.detach().to(loss.dtype), zeros) * loss
    loss = torch.where(valid, loss, zeros)

    with torch.no_grad():
        tokens = valid.sum().to(ratio.dtype)
        metrics: dict[str, Tensor] = {"policy/tokens": tokens}
        _token_metric(metrics, "policy/clip_frac_low", (ratio < 1.0 - clip_low) & (adv < 0), valid, tokens)
        _token_metric(metrics, "policy/clip_frac_high", (ratio > 1.0 + clip_high) & (adv > 0), valid, tokens)
        _token_metric(metrics, "policy/dual_clip_frac", is_dual_clipped, valid, tokens)
        _token_metric(metrics, "policy/ratio_mean", ratio, valid, tokens)
        # k1 estimate of KL(π_prox || π_θ): how far this step has already moved from its trust-region centre.
        _token_metric(metrics, "policy/ppo_kl", -log_ratio, valid, tokens)
    return loss, metrics


def aggregate_loss(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    mode: str,
    *,
    global_tokens: float,
    global_seqs: float,
    norm_constant: float | None = None,
) -> Tensor:
    """This micro-batch's share of the step loss, normalised by GLOBAL counts (§1.15).

    ``global_tokens``: valid tokens (sum of ``loss_mask``) over the whole optimizer step, all micro-batches and
    all data-parallel ranks. Used by ``token-mean`` only.
    ``global_seqs``: sequences with at least one valid token over the same scope. Used by ``seq-mean-token-mean``
    and ``seq-mean-token-sum``.
    ``norm_constant``: the constant C of ``seq-mean-token-sum-norm`` (Dr.GRPO), required there, unused elsewhere.
    Both counts are clamped to >= 1 so an all-masked step gives 0, not NaN.

    modes, with L = per_token_loss and m = loss_mask ([B, T]):
      token-mean               Σ_{i,t} m L / global_tokens
      seq-mean-token-mean      Σ_i (Σ_t m L / max(Σ_t m, 1)) / global_seqs   (a sequence's own token count)
      seq-mean-token-sum       Σ_{i,t} m L / global_seqs
      seq-mean-token-sum-norm  Σ_{i,t} m L / norm_constant
    Summing the result over every micro-batch of every rank gives the full-batch loss. Data-parallel wrappers
    (FSDP, DDP) AVERAGE gradients over ranks, so the caller multiplies the loss by the dp size, as verl does.
    """
    valid = loss_mask.bool()  # [B, T]
    masked = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss))  # [B, T]
    if mode == "token-mean":
        return masked.sum() / max(float(global_tokens), 1.0)
    if mode == "seq-mean-token-mean":
        seq_tokens = valid.sum(dim=-1).clamp(min=1).to(masked.dtype)  # [B]
        return (masked.sum(dim=-1) / seq_tokens).sum() / max(float(global_seqs), 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(float(global_seqs), 1.0)
    if mode == "seq-mean-token-sum-norm":
        if norm_constant is None or norm_constant <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs norm_constant > 0, got {norm_constant}")
        return masked.sum() / float(norm_constant)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGGREGATIONS}")


POLICY_LOSSES = {
    "ppo": ppo_clip_loss,
}

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
