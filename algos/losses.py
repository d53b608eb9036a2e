"""Policy losses and their aggregation over tokens (docs/algorithms.md §1, §1.15, §2.2, §2.7).

A policy loss is a pure function: [B, T] tensors in, ``(per_token_loss [B, T], metrics)`` out. It does NOT
reduce over tokens, because the right normaliser is a property of the whole optimizer step (all micro-batches
on all ranks), which one call cannot see. ``aggregate_loss`` does the reduction with global counts, so that
summing it over micro-batches gives exactly the full-batch loss, whatever the micro-batch composition.

Every loss has the signature
    loss(inputs: PolicyLossInputs, *, <its own hyperparameters>) -> (per_token_loss, metrics)
where ``loss_parts.PolicyLossInputs`` holds the tensors, all [B, T] and aligned on generated tokens:
- ``logprobs``        ℓθ, current learner pass; the only input that receives gradient.
- ``logprobs_centre`` the trust-region centre: ℓprox, the learner's policy at the start of the step, or ℓμ in
                      bypass mode. Losses without a ratio (gpg, reinforce, topr) only log metrics from it.
- ``advantages``      A, already broadcast per token.
- ``loss_mask``       1 on generated tokens that train, 0 elsewhere (prompt, tool output, padding).
- ``is_weight``       optional detached correction weight from ``corrections`` (0 where rejected). It multiplies the
                      per-token loss. Rejected tokens stay in ``loss_mask``, so the normaliser keeps the original
                      token count (AReaL/slime; masking must not inflate the kept tokens' gradient).
- ``logprobs_behav``  ℓμ, the generator's logprobs; read by topr only.
- ``generator``       the random generator of clip_cov's token sampling; read by clip_cov only.
The keyword defaults of each function are the published values (sources in its docstring), and the only place
they are written: ``registry.keyword_defaults`` reads them. Masked positions may hold anything (-inf logprobs,
NaN advantages): ``loss_parts`` replaces them before any arithmetic, so neither the loss nor the gradient can pick
up a NaN from them. Token-local losses live here; the sequence-ratio losses (gspo, gspo_token) in ``losses_seq``,
the covariance losses (clip_cov, kl_cov), whose token selection looks at the whole call, in ``losses_cov``.
``POLICY_LOSSES`` (name -> function) is built from ``registry.LOSSES``.

Metric convention (shared with ``corrections.py``; ``metrics.combine_token_metrics`` implements it):
- ``<area>/<name>``      mean over this call's valid tokens (handy for a single micro-batch);
- ``<area>/<name>_sum``  the same quantity summed over this call's valid tokens;
- ``<area>/tokens``      this call's valid-token count;
- ``<area>/.../max``     a max over this call's valid tokens.
To combine micro-batches or ranks: add every ``_sum`` and ``tokens`` (all-reduce SUM), take the max of every
``/max`` (all-reduce MAX), then ``<area>/<name> = <area>/<name>_sum / max(<area>/tokens, 1)``. Metric values are
detached 0-d tensors, so collecting them never forces a device sync. Every loss logs ``policy/ratio_mean`` and
``policy/ppo_kl``; ``policy/clip_frac_low`` / ``_high`` mean "the clipped branch is active" for the clipped losses.
"""
from collections.abc import Callable

import torch
from torch import Tensor

from asyncrl.algos.log_ratio import masked_log_ratio
from asyncrl.algos.loss_parts import (
    PolicyLossInputs,
    add_token_metric,
    check_clip_range,
    clipped_surrogate,
    finish_policy_loss,
    prepare_policy_inputs,
    start_policy_metrics,
)
from asyncrl.algos.losses_cov import clip_cov_loss, kl_cov_loss
from asyncrl.algos.losses_seq import gmpo_loss, gspo_loss, gspo_token_loss, sppo_loss
from asyncrl.algos.registry import LOSSES

__all__ = ["LOSS_AGGREGATIONS", "POLICY_LOSSES", "PolicyLossInputs", "aggregate_loss", "cispo_loss", "clip_cov_loss",
           "gpg_loss", "gspo_loss", "gspo_token_loss", "kl_cov_loss", "ppo_clip_loss", "reinforce_loss", "sapo_loss",
           "topr_loss"]


def ppo_clip_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip centred on π_prox (§1.1); the decoupled PPO objective (AReaL, §2.2) when ``is_weight`` is given.

    L_t = w_t * max(-u_t A_t, -clip(u_t, 1 - clip_low, 1 + clip_high) A_t),  u_t = exp(ℓθ_t - ℓprox_t).
    Defaults: ε_low 0.2 (verl/AReaL/OpenRLHF/slime), ε_high 0.28 (DAPO clip-higher, arXiv 2503.14476).
    Dual clip (Ye et al. 2019) caps the loss of A < 0 tokens at -c A, so one token whose ratio exploded cannot
    dominate the step (verl uses c = 3; off by default as in AReaL/OpenRLHF/slime). Clipping is centred on π_prox
    rather than the stale behaviour policy because a trust region around μ is the "improper clipping centre" that
    makes naive async PPO diverge (§2.2).
    """
    check_clip_range("ppo", clip_low, clip_high)
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    x = prepare_policy_inputs(inputs)
    loss, clipped_low, clipped_high = clipped_surrogate(x.ratio, x.advantages, clip_low, clip_high)  # [B, T]
    is_dual_clipped = torch.zeros_like(x.valid)
    if dual_clip_c is not None:
        cap = -dual_clip_c * x.advantages  # [B, T], positive where A < 0
        is_dual_clipped = (x.advantages < 0) & (loss > cap)
        loss = torch.where(x.advantages < 0, torch.minimum(loss, cap), loss)
    loss = finish_policy_loss(loss, x, inputs.is_weight)

    with torch.no_grad():
        metrics = start_policy_metrics(x)
        add_token_metric(metrics, "policy/clip_frac_low", clipped_low, x.valid, x.tokens)
        add_token_metric(metrics, "policy/clip_frac_high", clipped_high, x.valid, x.tokens)
        add_token_metric(metrics, "policy/dual_clip_frac", is_dual_clipped, x.valid, x.tokens)
    return loss, metrics


def cispo_loss(
    inputs: PolicyLossInputs,
    *,
    clip_low: float | None = None,
    clip_high: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, §1.6): L_t = -sg(clip(r_t, 1 - ε_low, 1 + ε_high)) A_t ℓθ_t.

    PPO zeroes the gradient of a token whose ratio left the trust region, which silences exactly the rare
    "reflection" tokens that move fastest. CISPO clips the importance weight instead and keeps REINFORCE's
    gradient on every token: clipped tokens still learn, with a bounded weight.
    ``clip_low=None`` means no lower bound: the paper sets ε_low large and tunes only ε_high. The paper gives no
    value for ε_high; the default 3.0 caps the weight at 4, the CISPO default of Thinking Machines' Tinker
    (clip_high_threshold=4.0, after ScaleRL, arXiv 2510.13786). DAPO-style runs use 0.28 (verl, Trinity-RFT).
    ``policy/clip_frac_low`` / ``_high``: tokens whose weight was clipped, whatever the sign of A.
    """
    check_clip_range("cispo", clip_low, clip_high)
    x = prepare_policy_inputs(inputs)
    lower = None if clip_low is None else 1.0 - clip_low
    weight = x.ratio.detach().clamp(min=lower, max=1.0 + clip_high)  # [B, T]
    loss = finish_policy_loss(-weight * x.advantages * x.logprobs, x, inputs.is_weight)

    with torch.no_grad():
        metrics = start_policy_metrics(x)
        below = x.ratio < lower if lower is not None else torch.zeros_like(x.valid)
        add_token_metric(metrics, "policy/clip_frac_low", below, x.valid, x.tokens)
        add_token_metric(metrics, "policy/clip_frac_high", x.ratio > 1.0 + clip_high, x.valid, x.tokens)
        add_token_metric(metrics, "policy/cispo_weight_mean", weight, x.valid, x.tokens)
    return loss, metrics


def sapo_loss(
    inputs: PolicyLossInputs,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO soft gate (arXiv 2511.20347, §1.13): L_t = -(4/τ) σ(τ (r_t - 1)) A_t, τ = τ_pos if A_t > 0 else τ_neg.

    A smooth trust region instead of PPO's hard clip: dL/dℓθ = -4 σ(1 - σ) r A, which is exactly REINFORCE's -A
    at r = 1 and decays smoothly as r leaves 1, so no token's gradient is cut off abruptly. τ_neg > τ_pos damps
    negative updates faster, because pushing probability down spreads it over the whole vocabulary.
    Defaults τ_pos 1.0, τ_neg 1.05: the paper's, verl ``compute_policy_loss_sapo`` (AReaL ``sapo_loss_fn``).
    ``policy/sapo_grad_scale``: mean of 4 σ(1 - σ) r, the gradient's weight relative to REINFORCE (1 at r = 1).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo: tau_pos/tau_neg must be > 0, got {tau_pos}/{tau_neg}")
    x = prepare_policy_inputs(inputs)
    tau = torch.where(x.advantages > 0, torch.full_like(x.ratio, tau_pos), torch.full_like(x.ratio, tau_neg))
    gate_prob = torch.sigmoid(tau * (x.ratio - 1.0))  # [B, T]
    loss = finish_policy_loss(-(4.0 / tau) * gate_prob * x.advantages, x, inputs.is_weight)

    with torch.no_grad():
        metrics = start_policy_metrics(x)
        grad_scale = 4.0 * gate_prob * (1.0 - gate_prob) * x.ratio
        add_token_metric(metrics, "policy/sapo_grad_scale", grad_scale, x.valid, x.tokens)
    return loss, metrics


def reinforce_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE: L_t = -sg(w_t) A_t ℓθ_t, w = ``is_weight`` or 1 (verl loss_type=reinforce, §2.2 bypass).

    No ratio and no trust region: all off-policy handling is the correction's weight (e.g. TIS: w = min(π_θ/μ, C)
    in bypass mode). ``logprobs_centre`` only feeds the ratio metrics.
    """
    x = prepare_policy_inputs(inputs)
    loss = finish_policy_loss(-x.advantages * x.logprobs, x, inputs.is_weight)
    with torch.no_grad():
        metrics = start_policy_metrics(x)
    return loss, metrics


def gpg_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (arXiv 2504.02546, §1.10): L_t = -w_t A_t ℓθ_t, plain policy gradient with no ratio, clip, KL or ref.

    The loss is REINFORCE's (verl ``compute_policy_loss_gpg`` is -A ℓθ); what makes GPG is its advantage (the
    ``gpg`` estimator's α = B / #{R ≠ 0} rescaling). A separate entry so that a config names the paper's recipe.
    """
    return reinforce_loss(inputs)


def topr_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """TOPR, tapered off-policy REINFORCE (arXiv 2503.14286, §2.7): L_t = -sg(w_t) A_t ℓθ_t with
    w_t = 1 if A_t >= 0, else min(1, π_θ(y)/μ(y)) = exp(min(0, Σ_s (ℓθ_s - ℓμ_s))) over the token's sequence.

    Positive samples keep the full SFT-like gradient without importance weights (they are what we want to imitate);
    negative samples are down-weighted by the truncated SEQUENCE ratio, so a stale failure the current policy would
    no longer produce cannot push its probability towards 0 without bound. The sign is read per token, so
    sequence-constant advantages give the paper's per-sample rule. It already corrects for μ: use it with
    correction none (the config rejects double corrections). Needs ``logprobs_behav``.
    """
    if inputs.logprobs_behav is None:
        raise ValueError("topr needs logprobs_behav: its weight on negative samples is min(1, π_θ(y)/μ(y))")
    x = prepare_policy_inputs(inputs)
    with torch.no_grad():
        log_rho = masked_log_ratio(inputs.logprobs.detach(), inputs.logprobs_behav, x.valid)  # [B, T], ℓθ - ℓμ
        seq_weight = torch.exp(log_rho.sum(dim=-1, keepdim=True).clamp(max=0.0))  # [B, 1], min(1, π_θ(y)/μ(y))
        negative = x.advantages < 0  # [B, T]
        weight = torch.where(negative, seq_weight.expand_as(log_rho), torch.ones_like(log_rho))
    loss = finish_policy_loss(-weight * x.advantages * x.logprobs, x, inputs.is_weight)

    with torch.no_grad():
        metrics = start_policy_metrics(x)
        add_token_metric(metrics, "policy/topr_negative_frac", negative, x.valid, x.tokens)
        add_token_metric(metrics, "policy/topr_truncated_frac", negative & (weight < 1.0), x.valid, x.tokens)
        add_token_metric(metrics, "policy/topr_weight_mean", weight, x.valid, x.tokens)
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


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    name: globals()[spec.function] for name, spec in LOSSES.items()}
"""Loss name -> function, resolved from ``registry.LOSSES`` (every loss is defined or imported above)."""

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
