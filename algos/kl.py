"""KL(π‖π_ref) estimators per token, the KL reward penalty and its coefficient controllers (docs/algorithms.md §1.16).

With δ_t = ℓ_t - ℓref_t on tokens y_t sampled from π (Schulman, joschu.net/blog/kl-approx.html):
- k1 = δ             unbiased value, but E∇k1 = 0: a reward penalty only, useless as a loss term;
- k2 = δ²/2          biased value (≈ KL for small δ), but E∇k2 = ∇KL(π‖π_ref): the right loss gradient;
- k3 = e^-δ - 1 + δ  ("low_var_kl") unbiased, ≥ 0 and low variance, but E∇k3 = ∇KL(π_ref‖π) (reverse KL);
- k3+                value of k3, gradient of k2 (straight-through): an unbiased, non-negative value to log
                     AND the forward-KL gradient (verl ``kl_penalty`` with a trailing "+");
- abs = |δ|          verl's ``abs``: a biased, non-negative value whose gradient sign(δ)∇ℓ pulls each token's
                     logprob toward the reference by a constant step, however far it is.
Numerics as verl ``kl_penalty_forward``: in k3, δ is clamped to ±LOG_RATIO_CLAMP before exp and k3 to [-10, 10];
k1 and k2 are not clamped (verl does not clamp them either). δ is ``log_ratio.masked_log_ratio`` without its clamp:
fp32 at least, and with ``loss_mask`` the garbage at masked positions (-inf - -inf = NaN) is replaced by 0 BEFORE
any arithmetic, since a NaN there would otherwise reach the gradient even through a later ``where``.
"""
import math
from collections.abc import Callable

import torch
from torch import Tensor

from asyncrl.algos.log_ratio import LOG_RATIO_CLAMP, masked_log_ratio

K3_CLAMP = 10.0
"""k3 is clamped to [-K3_CLAMP, K3_CLAMP] (verl): one token with an extreme ratio cannot dominate the penalty."""


def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = δ."""
    return log_ratio


def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = δ² / 2."""
    return 0.5 * log_ratio.square()


def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = π_ref/π - 1 - log(π_ref/π) = e^-δ - 1 + δ, with verl's clamps.

    expm1 instead of verl's exp(-δ) - 1: for small δ, exp(-δ) - 1 cancels and can round to a value below -δ,
    making k3 slightly negative; expm1(-δ) >= -δ keeps k3 >= 0 exactly, as the estimator is meant to be.
    """
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.expm1(-clamped) + clamped).clamp(-K3_CLAMP, K3_CLAMP)


def kl_k3_plus(log_ratio: Tensor) -> Tensor:
    """Straight-through: forward value k3, backward gradient of k2."""
    k2 = kl_k2(log_ratio)
    return k2 - k2.detach() + kl_k3(log_ratio).detach()


def kl_abs(log_ratio: Tensor) -> Tensor:
    """abs = |δ|."""
    return log_ratio.abs()


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "abs": kl_abs,
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "k3+": kl_k3_plus,
}


def compute_kl(logprobs: Tensor, logprobs_ref: Tensor, kind: str, *, loss_mask: Tensor | None = None) -> Tensor:
    """Per-token estimate [B, T] of KL(π‖π_ref) with estimator ``kind`` (k1, k2, k3, k3+).

    ``logprobs`` [B, T] may carry gradient (KL loss term); ``logprobs_ref`` is detached. With ``loss_mask`` the
    result is exactly 0 off-mask and neither value nor gradient can be NaN there.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    valid = torch.ones_like(logprobs, dtype=torch.bool) if loss_mask is None else loss_mask.bool()  # [B, T]
    log_ratio = masked_log_ratio(logprobs, logprobs_ref.detach(), valid, clamp=False)  # [B, T]
    return torch.where(valid, KL_ESTIMATORS[kind](log_ratio), 0.0)


def apply_kl_penalty(token_rewards: Tensor, logprobs_behav: Tensor, logprobs_ref: Tensor, loss_mask: Tensor, *,
                     coef: float, kind: str) -> tuple[Tensor, Tensor]:
    """Per-token KL reward shaping r_t - β KL_t (verl ``apply_kl_penalty``; InstructGPT-style).

    Returns (token_rewards - coef * kl on valid tokens and 0 off-mask [B, T], kl [B, T] detached, 0 off-mask).
    The KL is taken on the behaviour logprobs (the policy that produced the tokens), so the penalty is fixed
    when the batch is built, like verl's (which uses the old-policy logprobs). Pass ``kl`` to the controller
    as its masked mean.
    """
    valid = loss_mask.bool()  # [B, T]
    with torch.no_grad():
        kl = compute_kl(logprobs_behav.detach(), logprobs_ref, kind, loss_mask=loss_mask)  # [B, T]
        dtype = torch.promote_types(token_rewards.dtype, kl.dtype)
        rewards = token_rewards.detach().to(dtype)
        shaped = torch.where(valid, rewards - coef * kl.to(dtype), torch.zeros_like(rewards))
    return shaped, kl


class FixedKLController:
    """Constant KL coefficient β (verl ``FixedKLController``; verl's default kl_ctrl: fixed, 0.001)."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never moves."""


class AdaptiveKLController:
    """β that tracks a target KL (Ziegler et al. 2019, arXiv 1909.08593; verl ``AdaptiveKLController``).

    update: e = clip(current_kl / target - 1, -0.2, 0.2);  β <- β (1 + e · n_steps / horizon).
    The ±20 % clip keeps one noisy KL estimate from moving β far; ``n_steps`` (samples in the batch, as verl
    passes) over ``horizon`` sets how fast β follows. verl's defaults: kl_coef 0.001, target_kl 0.1,
    horizon 10000 (``verl/trainer/config/algorithm.py::KLControlConfig``).
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"need init_coef >= 0, target > 0 and horizon > 0, got {init_coef}, {target}, {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β toward the value that would give ``target``: up when current_kl > target, down when below. A
        non-finite KL (a poisoned batch, which the learner skips) leaves β as it was: a NaN β would poison every
        later step."""
        if not math.isfinite(current_kl):
            return
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
