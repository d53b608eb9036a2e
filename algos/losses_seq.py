"""Sequence-ratio policy losses: GSPO and GSPO-token (Qwen, arXiv 2507.18071; docs/algorithms.md §1.5), GMPO
(the geometric mean of clipped token ratios, arXiv 2507.20673; §1.13), and SPPO's squared regression of the
sequence log-ratio (arXiv 2405.00675; §1.17).

GSPO replaces PPO's per-token ratio by the length-normalised sequence ratio
    s_i = (π_θ(y_i|x) / π_prox(y_i|x))^(1/|y_i|) = exp(mean_t (ℓθ_t - ℓprox_t)),
the geometric mean of the token ratios. Token-level noise averages out (so precision mismatch between engines
matters less), and the value does not grow with the length the way the plain product exp(Σ_t log r_t) would.
Because s_i is near 1 by construction, the published clip range is tiny: ε_low 3e-4, ε_high 4e-4.

Both losses return a per-token loss like every other loss ([B, T], 0 off-mask), so the learner aggregates them
with any mode. With ``seq-mean-token-mean`` (the paper's and verl's choice) the aggregate is exactly the GSPO
objective (1/G) Σ_i max(-s_i A_i, -clip(s_i) A_i); every other mode weights each sequence by a per-sequence
constant (its length, or 1), and under any of them gspo and gspo_token have the same gradient whenever A is
constant over each sequence.
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
    sequence_mean,
    start_policy_metrics,
)

SEQ_LOG_RATIO_MAX = 10.0
"""log s_i is clamped to at most this before exp, as verl's compute_policy_loss_gspo does (pitfall §4.5)."""


def gspo_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: every valid token of sequence i carries L_i = max(-s_i A, -clip(s_i, 1 - ε_low, 1 + ε_high) A).

    s_i keeps its full gradient, so ∂L_i/∂ℓθ_t = -s_i A / |y_i| for every token t of the sequence: all tokens of a
    sequence are weighted equally, whatever their own ratio. GSPO is defined for sequence-level advantages; with
    advantages that vary over a sequence use ``gspo_token``, which gives each token its own A with the same
    sequence ratio. A token-level ``is_weight`` weights each token's copy of L_i; prefer a sequence-level
    correction (tis/mis level=sequence) for a consistently sequence-level objective.
    Defaults ε_low 3e-4, ε_high 4e-4: the GSPO paper's experiments (its GRPO baseline used 0.2/0.27).
    """
    check_clip_range("gspo", clip_low, clip_high)
    x = prepare_policy_inputs(inputs)
    seq_log_ratio = sequence_mean(x.log_ratio, x.valid).clamp(max=SEQ_LOG_RATIO_MAX)[:, None]  # [B, 1]
    seq_ratio = torch.exp(seq_log_ratio).expand_as(x.ratio)  # [B, T], s_i on every token of row i
    loss, clipped_low, clipped_high = clipped_surrogate(seq_ratio, x.advantages, clip_low, clip_high)
    loss = finish_policy_loss(loss, x, inputs.is_weight)
    return loss, _sequence_metrics(x, seq_log_ratio.detach(), clipped_low, clipped_high)


def gspo_token_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: L_t = max(-s_{i,t} A_t, -clip(s_{i,t}, 1 - ε_low, 1 + ε_high) A_t) with
    s_{i,t} = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t)), i.e. log s_{i,t} = ℓθ_t - sg(ℓθ_t) + sg(log s_i).

    Numerically s_{i,t} = s_i, but the gradient of token t is -s_i A_t ∇ℓθ_t: the sequence ratio decides the
    weight and the clipping, each token keeps its own advantage (process rewards, per-token KL penalties). This is
    what verl's ``compute_policy_loss_gspo`` computes. Defaults ε_low 3e-4, ε_high 4e-4 (GSPO paper).
    """
    check_clip_range("gspo_token", clip_low, clip_high)
    x = prepare_policy_inputs(inputs)
    seq_log_ratio = sequence_mean(x.log_ratio.detach(), x.valid)[:, None]  # [B, 1]
    # ℓθ - sg(ℓθ) is exactly 0 in value and 1 in gradient; the clamp after the sum kills the gradient of a
    # sequence whose ratio exploded, as verl's does.
    token_log_ratio = (x.logprobs - x.logprobs.detach() + seq_log_ratio).clamp(max=SEQ_LOG_RATIO_MAX)  # [B, T]
    loss, clipped_low, clipped_high = clipped_surrogate(torch.exp(token_log_ratio), x.advantages, clip_low,
                                                        clip_high)
    loss = finish_policy_loss(loss, x, inputs.is_weight)
    return loss, _sequence_metrics(x, seq_log_ratio.clamp(max=SEQ_LOG_RATIO_MAX), clipped_low, clipped_high)


def gmpo_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: maximise the geometric mean of the token-level clipped objectives instead of their arithmetic mean.

    Per sequence i, with A_i its mean advantage and σ = sign(A_i), each token's log-ratio is clipped in LOG space
    the pessimistic way, ℓ'_t = σ · min(σ log u_t, σ clip(log u_t, -ε_low, ε_high)), and
        L_i = -A_i · exp(mean_t ℓ'_t)
    sits on every valid token of the row (as GSPO's). Under ``seq-mean-token-mean`` the aggregate is the paper's
    objective. The geometric mean is insensitive to a single outlier ratio, so the clip range can be much wider
    than PPO's: ε = 0.4 on each side (e^±0.4) is the paper's and verl's GMPO recipe. A clipped token gets no
    gradient; the others share the sequence's weight: ∂L_i/∂ℓθ_t = -A_i exp(mean ℓ') / |y_i|.
    """
    check_clip_range("gmpo", clip_low, clip_high)
    x = prepare_policy_inputs(inputs)
    seq_advantage = sequence_mean(x.advantages, x.valid)[:, None]  # [B, 1]
    sign = torch.where(seq_advantage >= 0, 1.0, -1.0).to(x.log_ratio.dtype)  # [B, 1]
    clipped_log_ratio = x.log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * x.log_ratio, sign * clipped_log_ratio)  # [B, T]
    seq_log_ratio = sequence_mean(pessimistic, x.valid).clamp(max=SEQ_LOG_RATIO_MAX)[:, None]  # [B, 1]
    loss = (-seq_advantage * torch.exp(seq_log_ratio)).expand_as(x.ratio)
    loss = finish_policy_loss(loss, x, inputs.is_weight)
    with torch.no_grad():
        active = pessimistic != x.log_ratio  # the clipped branch: no gradient
        clipped_low = active & (x.log_ratio < -clip_low)
        clipped_high = active & (x.log_ratio > clip_high)
    return loss, _sequence_metrics(x, seq_log_ratio.detach(), clipped_low, clipped_high)


def sppo_loss(
    inputs: PolicyLossInputs,
    *,
    eta: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SPPO (self-play preference optimisation, arXiv 2405.00675; verl's recipe/sppo ``compute_sppo_loss``): a
    regression of each sequence's log-ratio against the policy that sampled it onto its target,

        ρ_i = Σ_t (ℓθ_t - ℓcentre_t),   L_i = ½ (ρ_i - η s_i)²,

    with s_i the sequence's advantage (its mean over the valid tokens: the ``sppo`` estimator gives
    s_i = R_i - SM_η(R), R's soft-mean over the prompt's group). The minimiser is the multiplicative-weights step
    π_{t+1} ∝ π_t exp(η R): log(π_{t+1}/π_t) = η R - log Z = η (R - SM_η(R)). No clipping, no reference model: the
    regression itself keeps π_θ near π_t. The centre must be the sampling policy π_t, so the loss pairs with
    ``algo.correction=bypass`` (centre = μ). The ½ makes the gradient at ρ = 0 exactly -η s_i ∇ρ_i, REINFORCE's
    with advantage η s_i, as every asyncrl loss's is at its centre (so one learning rate means the same across
    losses); verl's value is twice this, with the same minimiser. L_i sits on every valid token of row i, so
    ``seq-mean-token-mean`` (required) averages it over sequences as verl does. η = 1: verl's ``sppo_eta`` default
    (the original code's η = 1/β = 1000 scaled a win-rate in [0, 1], not a reward).
    """
    if not eta > 0:
        raise ValueError(f"sppo's eta must be > 0, got {eta}")
    x = prepare_policy_inputs(inputs)
    seq_log_ratio = torch.where(x.valid, x.log_ratio, torch.zeros_like(x.log_ratio)).sum(dim=-1)  # [B] ρ_i
    target = eta * sequence_mean(x.advantages, x.valid)  # [B] η s_i
    per_sequence = 0.5 * (seq_log_ratio - target).square()  # [B]
    loss = finish_policy_loss(per_sequence[:, None].expand_as(x.ratio), x, inputs.is_weight)
    metrics = start_policy_metrics(x)
    with torch.no_grad():  # token-weighted, like every other policy/ mean: a sequence counts once per valid token
        add_token_metric(metrics, "policy/sppo_log_ratio", seq_log_ratio[:, None].expand_as(x.ratio), x.valid,
                         x.tokens)
        add_token_metric(metrics, "policy/sppo_residual_abs", (seq_log_ratio - target).abs()[:, None].expand_as(
            x.ratio), x.valid, x.tokens)
    return loss, metrics


@torch.no_grad()
def _sequence_metrics(x: PolicyInputs, seq_log_ratio: Tensor, clipped_low: Tensor,
                      clipped_high: Tensor) -> dict[str, Tensor]:
    """Token-weighted metrics: a sequence counts once per valid token, like every other ``policy/`` mean.

    ``policy/seq_ratio_mean``: mean of s_i over tokens; ``policy/seq_log_ratio_abs/max``: max_i |log s_i|, how far
    the furthest sequence has moved; ``policy/clip_frac_*``: tokens of sequences whose clipped branch is active.
    """
    metrics = start_policy_metrics(x)
    seq_log_ratio = seq_log_ratio.expand_as(x.ratio)  # [B, T]
    add_token_metric(metrics, "policy/clip_frac_low", clipped_low, x.valid, x.tokens)
    add_token_metric(metrics, "policy/clip_frac_high", clipped_high, x.valid, x.tokens)
    add_token_metric(metrics, "policy/seq_ratio_mean", torch.exp(seq_log_ratio), x.valid, x.tokens)
    add_max_metric(metrics, "policy/seq_log_ratio_abs", seq_log_ratio.abs(), x.valid)
    return metrics
