"""Pieces shared by every policy loss (losses.py, losses_seq.py, losses_cov.py): their typed input, and the two ends
every loss has in common.

``PolicyLossInputs`` is what every loss receives (shapes in the field comments); each loss takes only its own
hyperparameters as keywords. Each loss begins the same way (``prepare_policy_inputs``): pick the valid tokens, form
the log-ratio to the trust-region centre with ``log_ratio.masked_log_ratio`` (fp32 or wider, padding neutralised
before any arithmetic, clamped), and zero whatever sits at padding (-inf log-probs, NaN advantages) with
``torch.where``, never by multiplying with the mask: 0 * NaN is NaN. Each loss ends the same way
(``finish_policy_loss``): multiply by the detached correction weight and zero the padding. Keeping both ends here
means a padding rule is fixed once for all ten losses. The PPO clipped surrogate lives here too because ppo, gspo,
gspo_token and clip_cov share it.

Metric helpers implement the convention documented in losses.py (``_sum`` / ``tokens`` / ``/max``).
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from asyncrl.algos.log_ratio import masked_log_ratio


@dataclass(frozen=True)
class PolicyLossInputs:
    """The tensors every policy loss reads, all [B, T] and aligned on generated tokens. Masked positions may hold
    anything (-inf log-probs, NaN advantages): the losses never let them reach arithmetic."""

    logprobs: Tensor  # [B, T] ℓθ, the current pass; the only input with gradient
    logprobs_centre: Tensor  # [B, T] trust-region centre: ℓprox, or ℓμ in bypass mode (detached by the loss)
    advantages: Tensor  # [B, T] A, already broadcast per token (detached by the loss)
    loss_mask: Tensor  # [B, T] 1 on generated tokens that train, 0 elsewhere (prompt, tool output, padding)
    logprobs_behav: Tensor | None = None  # [B, T] ℓμ, the generator's logprobs; topr reads it
    is_weight: Tensor | None = None  # [B, T] detached correction weight (0 where rejected), or None
    generator: torch.Generator | None = None  # clip_cov's token sampling; None uses torch's global generator


class PolicyInputs(NamedTuple):
    """The common inputs of a policy loss with padding neutralised. All [B, T] except ``tokens`` (0-d)."""

    valid: Tensor  # bool, loss_mask != 0
    tokens: Tensor  # valid-token count of this call, in the compute dtype
    logprobs: Tensor  # ℓθ upcast to >= fp32, 0 off-mask; the only input that carries gradient
    log_ratio: Tensor  # ℓθ - ℓcentre, 0 off-mask, clamped to ±LOG_RATIO_CLAMP; carries gradient
    ratio: Tensor  # r = exp(log_ratio), 1 off-mask
    advantages: Tensor  # A, detached, 0 off-mask


def prepare_policy_inputs(inputs: PolicyLossInputs) -> PolicyInputs:
    """Padding-safe, upcast inputs of a policy loss; the centre and the advantages are detached."""
    valid = inputs.loss_mask.bool()  # [B, T]
    log_ratio = masked_log_ratio(inputs.logprobs, inputs.logprobs_centre.detach(), valid)  # [B, T]
    zeros = torch.zeros_like(log_ratio)
    return PolicyInputs(
        valid=valid,
        tokens=valid.sum().to(log_ratio.dtype),
        logprobs=torch.where(valid, inputs.logprobs.to(log_ratio.dtype), zeros),
        log_ratio=log_ratio,
        ratio=torch.exp(log_ratio),
        advantages=torch.where(valid, inputs.advantages.detach().to(log_ratio.dtype), zeros),
    )


def finish_policy_loss(loss: Tensor, inputs: PolicyInputs, is_weight: Tensor | None) -> Tensor:
    """Multiply the per-token loss by the detached correction weight, if any, and zero the padding. [B, T]."""
    zeros = torch.zeros_like(loss)
    if is_weight is not None:
        # Detached here as well as by the correction: a gradient through w adds a log π · ∇w bias (pitfall §4.5).
        loss = torch.where(inputs.valid, is_weight.detach().to(loss.dtype), zeros) * loss
    return torch.where(inputs.valid, loss, zeros)


def sequence_mean(values: Tensor, valid: Tensor) -> Tensor:
    """Mean of ``values`` over each row's valid tokens, [B, T] -> [B]; 0 for a row without any."""
    counts = valid.sum(dim=-1).clamp(min=1).to(values.dtype)  # [B]
    return torch.where(valid, values, torch.zeros_like(values)).sum(dim=-1) / counts


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float,
                      clip_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic surrogate max(-r A, -clip(r, 1 - ε_low, 1 + ε_high) A), all [B, T].

    Returns (loss, clipped_low, clipped_high): the two masks mark tokens where the clipped branch is active,
    i.e. where the gradient is 0 (A < 0 with r < 1 - ε_low, A > 0 with r > 1 + ε_high).
    """
    loss_unclipped = -ratio * advantages
    loss_clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    is_clipped = loss_clipped > loss_unclipped
    return torch.maximum(loss_unclipped, loss_clipped), is_clipped & (advantages < 0), is_clipped & (advantages > 0)


def check_clip_range(loss_name: str, clip_low: float | None, clip_high: float) -> None:
    """Reject negative clip ranges, naming the loss (``clip_low`` None: no lower bound, cispo)."""
    if (clip_low is not None and clip_low < 0) or clip_high < 0:
        raise ValueError(f"{loss_name}: clip_low/clip_high must be >= 0, got {clip_low}/{clip_high}")


def add_token_metric(metrics: dict, name: str, per_token: Tensor, valid: Tensor, tokens: Tensor) -> None:
    """``name_sum`` (sum over valid tokens) and ``name`` (its mean over this call's tokens)."""
    total = torch.where(valid, per_token.to(tokens.dtype), torch.zeros_like(tokens)).sum()
    metrics[f"{name}_sum"] = total
    metrics[name] = total / tokens.clamp(min=1.0)


def add_max_metric(metrics: dict, name: str, per_token: Tensor, valid: Tensor) -> None:
    """``name/max`` over valid tokens; 0 when there is none (an -inf would poison the run's plots)."""
    values = per_token.to(torch.promote_types(per_token.dtype, torch.float32))
    top = torch.where(valid, values, torch.full_like(values, -torch.inf)).amax()
    metrics[f"{name}/max"] = torch.where(valid.any(), top, torch.zeros_like(top))


def start_policy_metrics(inputs: PolicyInputs) -> dict[str, Tensor]:
    """Metrics every loss logs, so runs with different losses plot alike: token count, mean ratio r to the
    trust-region centre, and ppo_kl = mean(ℓprox - ℓθ), the k1 estimate of how far this step has already moved."""
    metrics = {"policy/tokens": inputs.tokens.detach()}
    add_token_metric(metrics, "policy/ratio_mean", inputs.ratio.detach(), inputs.valid, inputs.tokens)
    add_token_metric(metrics, "policy/ppo_kl", -inputs.log_ratio.detach(), inputs.valid, inputs.tokens)
    return metrics
