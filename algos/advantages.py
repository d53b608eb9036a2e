"""Advantage estimators: rewards of a prompt group in, one advantage per completion out.

Estimators take rewards shaped [num_groups, n] (row = the n completions of one prompt) and return advantages of
the same shape. The learner broadcasts each completion's advantage over its generated tokens, so an estimator
never sees tokens, masks or logprobs. That keeps them trivially testable and lets any estimator pair with any
policy loss (DESIGN.md §5).

GRPO follows verl's `compute_grpo_outcome_advantage` (reference/offpolicy_algorithms.md §1.2), because users
compare curves against verl:
- the group std is the unbiased one (N-1 denominator);
- a singleton group (n == 1) has no baseline: mean 0 and std 1, so A = R (verl gives R / (1 + eps));
- eps is added to the std, not to the variance, so an all-equal group gives exactly 0 (0 / eps), never NaN.
"""
import torch
from torch import Tensor


def compute_grpo_advantages(rewards: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-normalised advantages; Dr.GRPO (arXiv 2503.20783) when ``norm_by_std`` is False.

    A = (R - mean_group R) / (std_group R + eps), or A = R - mean_group R without std normalisation; Dr.GRPO
    drops the std because it up-weights groups that are nearly all right or all wrong.
    """
    # rewards: [num_groups, n]
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, n], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.shape[1] == 1:
        # A lone completion has no group baseline: mean 0, std 1 (verl), and A = R exactly (no eps).
        return rewards.clone()
    mean = rewards.mean(dim=1, keepdim=True)  # [num_groups, 1]
    std = rewards.std(dim=1, keepdim=True, unbiased=True)  # [num_groups, 1]
    centred = rewards - mean  # [num_groups, n]
    if not norm_by_std:
        return centred
    return centred / (std + eps)


ADVANTAGES = {
    "grpo": compute_grpo_advantages,
}
