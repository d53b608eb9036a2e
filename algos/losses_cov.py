"""Covariance-controlled losses: Clip-Cov and KL-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning
LMs", arXiv 2505.22617; docs/algorithms.md §1.11).

The paper shows that policy entropy falls in proportion to the covariance between a token's log-probability and
its advantage: confident tokens (high ℓθ) with high advantage are the ones whose update collapses entropy. Both
losses find those tokens by the per-token centred product
    Cov_t = (ℓθ_t - mean(ℓθ)) · (A_t - mean(A))
and restrain only them, a tiny fraction of the batch, leaving PPO untouched elsewhere:
- Clip-Cov samples uniformly ``max(1, floor(cov_ratio · N))`` tokens with cov_low < Cov_t < cov_high that PPO has
  not already clipped, and zeroes their loss (value and gradient);
- KL-Cov takes the ``max(1, floor(cov_ratio · N))`` tokens of largest Cov_t and adds kl_coef · |ℓθ - ℓprox| to
  their unclipped loss -r A; the others get -r A with no clip at all.
The count is floor, not the paper's ⌈r N⌉, as in verl (``max(int(ratio * N), 1)``).

The means, N and the selection are over the tensors passed in: ONE CALL = ONE MICRO-BATCH, as in verl. Unlike the
other losses, the result for a token therefore depends on which other tokens share its micro-batch, and
micro-batching changes the loss slightly; with the recipes' ratios (2e-4, 2e-3) a micro-batch of a few thousand
tokens selects about one token either way. Choosing N also needs one device-to-host copy per call.
"""
import torch
from torch import Tensor

from asyncrl.algos.loss_parts import (
    PolicyInputs,
    PolicyLossInputs,
    add_max_metric,
    add_token_metric,
    check_clip_range,
    clipped_surrogate,
    finish_policy_loss,
    prepare_policy_inputs,
    start_policy_metrics,
)


def clip_cov_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 1.0,
    clip_high: float = 1.0,
    cov_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO-clip, except that a random few high-covariance tokens get loss 0 (no gradient).

    L_t = 0 for the selected tokens, max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A) for the others.
    Defaults: cov_ratio 2e-4, cov_low 1, cov_high 5 (verl and the paper's Clip-Cov scripts, which also set
    clip_ratio_low = clip_ratio_high = 1, i.e. r clipped to [0, 2]: hence clip_low = clip_high = 1.0).
    ``inputs.generator`` drives the uniform sampling (pass a seeded one for reproducible runs; None uses torch's
    global generator). Selection is per call: see the module doc.
    """
    check_clip_range("clip_cov", clip_low, clip_high)
    _check_cov_ratio("clip_cov", cov_ratio)
    if not cov_low < cov_high:
        raise ValueError(f"clip_cov: cov_low must be < cov_high, got {cov_low}/{cov_high}")
    x = prepare_policy_inputs(inputs)
    loss, clipped_low, clipped_high = clipped_surrogate(x.ratio, x.advantages, clip_low, clip_high)  # [B, T]
    with torch.no_grad():
        cov = _token_covariance(x)  # [B, T]
        candidates = x.valid & ~(clipped_low | clipped_high) & (cov > cov_low) & (cov < cov_high)
        selected = _sample_tokens(candidates, _selection_count(cov_ratio, x.tokens), inputs.generator)  # [B, T]
    loss = finish_policy_loss(torch.where(selected, torch.zeros_like(loss), loss), x, inputs.is_weight)

    with torch.no_grad():
        metrics = _cov_metrics(x, cov, selected)
        add_token_metric(metrics, "policy/clip_frac_low", clipped_low, x.valid, x.tokens)
        add_token_metric(metrics, "policy/clip_frac_high", clipped_high, x.valid, x.tokens)
        add_token_metric(metrics, "policy/cov_candidate_frac", candidates, x.valid, x.tokens)
    return loss, metrics


def kl_cov_loss(
    inputs: PolicyLossInputs,
    *,
    cov_ratio: float = 2e-3,
    kl_coef: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: L_t = -r_t A_t + kl_coef · |ℓθ_t - ℓprox_t| on the top-k tokens by Cov_t, -r_t A_t elsewhere.

    The penalty pulls only the entropy-collapsing tokens back towards π_prox; there is no ratio clipping at all.
    Defaults: cov_ratio 2e-3 and kl_coef 1 from the paper's 7B KL-Cov script (k_percent 0.2 %, ppo_kl_coef 1);
    its 32B script uses 2e-4, which is also verl's kl_cov_ratio default. Selection is per call (module doc).
    ``policy/abs_kl``: mean |ℓθ - ℓprox| over all valid tokens (what verl logs as ppo_kl for this loss).
    """
    _check_cov_ratio("kl_cov", cov_ratio)
    if kl_coef < 0:
        raise ValueError(f"kl_cov: kl_coef must be >= 0, got {kl_coef}")
    x = prepare_policy_inputs(inputs)
    with torch.no_grad():
        cov = _token_covariance(x)  # [B, T]
        count = _selection_count(cov_ratio, x.tokens)
        scores = torch.where(x.valid, cov, torch.full_like(cov, -torch.inf)).flatten()  # [B*T]
        selected = torch.zeros_like(scores, dtype=torch.bool)
        selected[torch.topk(scores, count).indices] = True
        selected = selected.view_as(x.valid)  # [B, T]
    penalty = kl_coef * x.log_ratio.abs()  # [B, T]; |·| has gradient 0 at ℓθ = ℓprox
    loss = -x.ratio * x.advantages + torch.where(selected, penalty, torch.zeros_like(penalty))
    loss = finish_policy_loss(loss, x, inputs.is_weight)

    with torch.no_grad():
        metrics = _cov_metrics(x, cov, selected)
        add_token_metric(metrics, "policy/abs_kl", x.log_ratio.abs(), x.valid, x.tokens)
    return loss, metrics


def _check_cov_ratio(loss_name: str, cov_ratio: float) -> None:
    if not 0 < cov_ratio <= 1:
        raise ValueError(f"{loss_name}: cov_ratio must be in (0, 1], got {cov_ratio}")


def _token_covariance(x: PolicyInputs) -> Tensor:
    """Cov_t = (ℓθ_t - mean ℓθ)(A_t - mean A), means over this call's valid tokens; 0 off-mask. [B, T]."""
    tokens = x.tokens.clamp(min=1.0)
    logprobs = x.logprobs.detach()  # already 0 off-mask
    centred = (logprobs - logprobs.sum() / tokens) * (x.advantages - x.advantages.sum() / tokens)
    return torch.where(x.valid, centred, torch.zeros_like(centred))


def _selection_count(cov_ratio: float, tokens: Tensor) -> int:
    """max(1, floor(cov_ratio · N)) for N valid tokens (verl), 0 when there is none."""
    n = int(tokens.item())
    return max(1, int(cov_ratio * n)) if n > 0 else 0


def _sample_tokens(candidates: Tensor, count: int, generator: torch.Generator | None) -> Tensor:
    """Boolean [B, T] mask of ``count`` candidates drawn uniformly without replacement (all if fewer)."""
    index = candidates.flatten().nonzero().squeeze(-1)  # [K]
    device = generator.device if generator is not None else index.device
    order = torch.randperm(index.numel(), generator=generator, device=device).to(index.device)
    selected = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    selected[index[order[:count]]] = True
    return selected.view_as(candidates)


def _cov_metrics(x: PolicyInputs, cov: Tensor, selected: Tensor) -> dict[str, Tensor]:
    metrics = start_policy_metrics(x)
    add_token_metric(metrics, "policy/cov_selected_frac", selected, x.valid, x.tokens)
    add_max_metric(metrics, "policy/cov", cov, x.valid)
    return metrics
