"""Off-policy corrections: the detached per-token weight that multiplies any policy loss (§2.2, DESIGN.md §5).

A correction is chosen independently of the loss: it only produces ``is_weight`` [B, T] (or None), which every
loss in ``losses.POLICY_LOSSES`` accepts. Keeping the two apart is what guarantees nothing is corrected twice.

``decoupled`` is AReaL's decoupled PPO weight w = π_prox / π_behav: it moves samples drawn from the stale
generator policy onto the learner's step-start policy, while the loss's own ratio u = π_θ / π_prox keeps the
trust region centred on π_prox. Large w come from stale or mismatched tokens and would dominate the gradient, so
they are bounded:
- ``truncate``: w <- min(w, cap)   (TIS; biased but low variance);
- ``mask``:     w <- w * [w <= cap] (MIS / AReaL's old behave_imp_weight_cap; drops the toxic tail).
Masked tokens keep their place in ``loss_mask``, so the loss normaliser still counts them (§1.15).
The weight is always detached: a gradient through w would add a log π · ∇w bias term (pitfall §4.5).

Metrics follow the convention of ``losses.py`` (means, ``_sum``, ``offpolicy/tokens``, ``/max``) and are taken
over valid tokens BEFORE truncation, so they show how off-policy the data really was.
"""
from collections.abc import Callable

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""|log w| is clamped to this before exp, as for the PPO ratio: e^20 is finite in fp32 and bf16."""

IS_WEIGHT_MODES = ("truncate", "mask")


def _no_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, cap: float, mode: str
) -> tuple[None, dict[str, Tensor]]:
    # On-policy (or bypass) training: the loss ratio already compares against the right policy.
    return None, {}


def _decoupled_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, cap: float, mode: str
) -> tuple[Tensor, dict[str, Tensor]]:
    valid = loss_mask.bool()  # [B, T]
    dtype = torch.promote_types(logprobs_prox.dtype, torch.float32)
    with torch.no_grad():
        log_w = logprobs_prox.to(dtype) - logprobs_behav.to(dtype)  # [B, T]
        # where(), not *mask: -inf - -inf = NaN at padding.
        log_w = torch.where(valid, log_w, torch.zeros_like(log_w)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        raw = torch.exp(log_w)  # [B, T], before truncation
        above_cap = valid & (raw > cap)  # [B, T]
        if mode == "truncate":
            weight = raw.clamp(max=cap)
        else:
            weight = torch.where(above_cap, torch.zeros_like(raw), raw)
        weight = torch.where(valid, weight, torch.zeros_like(weight))  # [B, T]

        zeros = torch.zeros_like(raw)
        tokens = valid.sum().to(dtype)
        denom = tokens.clamp(min=1.0)
        raw_sum = torch.where(valid, raw, zeros).sum()
        above_sum = above_cap.sum().to(dtype)
        truncated_sum = above_sum if mode == "truncate" else zeros.sum()
        masked_sum = above_sum if mode == "mask" else zeros.sum()
        metrics = {
            "offpolicy/tokens": tokens,
            # 0 when there is no valid token; weights are positive, so 0 never wins a max across micro-batches.
            "offpolicy/is_weight/max": torch.where(valid, raw, zeros).max() if raw.numel() else zeros.sum(),
            "offpolicy/is_weight/mean": raw_sum / denom,
            "offpolicy/is_weight/mean_sum": raw_sum,
            "offpolicy/truncated_frac": truncated_sum / denom,
            "offpolicy/truncated_frac_sum": truncated_sum,
            "offpolicy/masked_frac": masked_sum / denom,
            "offpolicy/masked_frac_sum": masked_sum,
        }
    return weight, metrics


CORRECTIONS: dict[str, Callable[..., tuple[Tensor | None, dict[str, Tensor]]]] = {
    "none": _no_weight,
    "decoupled": _decoupled_weight,
}


def compute_is_weight(
    logprobs_prox: Tensor,
    logprobs_behav: Tensor,
    loss_mask: Tensor,
    *,
    correction: str,
    cap: float = 5.0,
    mode: str = "truncate",
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The detached importance weight [B, T] for ``correction`` (None when no weight applies), and metrics.

    ``cap`` bounds w = π_prox / π_behav (AReaL's default 5.0); ``mode`` is ``truncate`` or ``mask``.
    ``logprobs_prox`` must be the pass frozen at the start of the step, not one recomputed per mini-batch
    (pitfall §4.6). The function is elementwise, so calling it per micro-batch gives the same weights.
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown correction {correction!r}; choose one of {tuple(CORRECTIONS)}")
    if mode not in IS_WEIGHT_MODES:
        raise ValueError(f"unknown is_weight mode {mode!r}; choose one of {IS_WEIGHT_MODES}")
    if cap <= 0:
        raise ValueError(f"is_weight cap must be > 0, got {cap}")
    return CORRECTIONS[correction](logprobs_prox, logprobs_behav, loss_mask, cap, mode)
