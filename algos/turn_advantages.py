"""Advantages of per-turn samples (rollout.turn_samples=per_turn): each model turn of an episode is its own row,
and every turn gets its episode's advantage, as verl's and AReaL's per-turn modes do.

The group baseline is over episodes, not rows: a group of n episodes sends more than n rows (one per turn), and
an episode of five turns must not weigh five times in its prompt's mean. So the estimator runs on one row per
episode, whose outcome is the episode's reward, and the result is broadcast over the valid tokens of each of its
turns. The episode's outcome is the mean of its turns' outcomes: the turns carry the same reward (the buffer
checks it), so without a KL reward penalty this is exactly the episode's reward; with one it is that reward minus
the mean per-turn KL. Only estimators whose advantage is one number per completion from the group's rewards are
offered (algos/config.py PER_TURN_ADVANTAGES); token-level ones (reinforce_pp, GAE, V-trace) would need the turns
as one sequence, which per-turn samples are precisely not.
"""
import torch
from torch import Tensor

from asyncrl.algos.advantages import AdvantageInputs, compute_token_advantages


def compute_turn_advantages(name: str, token_rewards: Tensor, loss_mask: Tensor, row_episodes: Tensor,
                            group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages [B, T] (0 off-mask) of estimator `name`, each row's its episode's.

    token_rewards, loss_mask: [B, T], one row per turn; row_episodes: [B] int, the row's episode as
    group * group_size + its index in the group, every one of 0 .. num_groups * group_size - 1 present.
    """
    valid = loss_mask.bool()
    dtype = torch.promote_types(token_rewards.dtype, torch.float32)
    rewards = torch.where(valid, token_rewards.detach().to(dtype), torch.zeros((), dtype=dtype))
    row_outcome = rewards.sum(dim=-1)  # [B]
    num_episodes = int(row_episodes.max()) + 1
    if num_episodes % group_size != 0:
        raise ValueError(f"{num_episodes} episodes do not split into groups of {group_size}")
    totals = torch.zeros(num_episodes, dtype=dtype).index_add_(0, row_episodes, row_outcome)  # [E]
    turns = torch.zeros(num_episodes, dtype=dtype).index_add_(0, row_episodes, torch.ones_like(row_outcome))
    if bool((turns == 0).any()):
        raise ValueError("an episode has no row: every episode of a group needs at least one turn")
    outcome = (totals / turns).unsqueeze(-1)  # [E, 1]: the episode's reward on its one "token"
    inputs = AdvantageInputs(token_rewards=outcome, loss_mask=torch.ones_like(outcome), group_size=group_size)
    per_episode = compute_token_advantages(name, inputs, norm_by_std=norm_by_std, eps=eps)[:, 0]  # [E]
    per_row = per_episode[row_episodes].unsqueeze(-1).expand_as(rewards)  # [B, T]
    return torch.where(valid, per_row, torch.zeros_like(per_row))
