"""The critic's side of PPO (docs/algorithms.md §1.14): the clipped value loss and the explained variance.

Conventions follow verl ``verl/trainer/ppo/core_algos.py::compute_value_loss`` and its data metrics, because users
compare curves against verl:
- the prediction is clipped to within ``cliprange`` of the values the advantages were computed from (the critic at
  the start of the step), and the loss per token is ½·max((V - R)², (V_clipped - R)²): the pessimistic one, as the
  policy's PPO clip;
- the clip fraction counts the tokens where the clipped error is the larger one (the clip bit);
- the explained variance is 1 - Var(R - V) / Var(R) over the batch's valid tokens (unbiased variances), with V the
  values the advantages used: 1 is a perfect critic, 0 one no better than the mean return, below 0 worse.
Masked positions may hold garbage (NaN, inf): they are replaced before any arithmetic.
"""
import torch
from torch import Tensor

EXPLAINED_VAR_EPS = 1e-5
"""Added to Var(R) so a batch of equal returns gives a finite number (verl's epsilon)."""


def compute_value_loss(vpreds: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor,
                       cliprange: float) -> tuple[Tensor, Tensor]:
    """(per-token loss [B, T] with the gradient of ``vpreds``, clipped [B, T] bool), both 0/False off-mask.

    vpreds: the critic's values now (with grad); old_values: its values when the advantages were computed
    (detached); returns: the regression targets (GAE's Â + V, or V-trace's v_s). The caller aggregates the
    per-token loss over the step like the policy loss (``losses.aggregate_loss``)."""
    if cliprange <= 0:
        raise ValueError(f"cliprange must be > 0, got {cliprange}")
    valid = loss_mask.bool()
    zeros = torch.zeros_like(vpreds)
    old = torch.where(valid, old_values.detach().to(vpreds.dtype), zeros)
    target = torch.where(valid, returns.detach().to(vpreds.dtype), zeros)
    vpreds = torch.where(valid, vpreds, zeros)
    clipped_preds = old + (vpreds - old).clamp(-cliprange, cliprange)
    unclipped_loss = (vpreds - target).square()
    clipped_loss = (clipped_preds - target).square()
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    return torch.where(valid, per_token, zeros), valid & (clipped_loss > unclipped_loss)


def explained_variance(values: Tensor, returns: Tensor, loss_mask: Tensor) -> float:
    """1 - Var(returns - values) / (Var(returns) + eps) over the valid tokens; nan with fewer than two."""
    valid = loss_mask.bool()
    if int(valid.sum()) < 2:
        return float("nan")
    dtype = torch.promote_types(values.dtype, torch.float64)
    target, predicted = returns[valid].to(dtype), values[valid].to(dtype)
    return float(1.0 - (target - predicted).var() / (target.var() + EXPLAINED_VAR_EPS))
