"""Advantage estimators: token rewards of a batch of prompt groups in, one advantage per generated token out.

Every estimator in ``ADVANTAGES`` reads the same ``AdvantageInputs`` and returns advantages [B, T], 0 off-mask,
so any estimator pairs with any policy loss (docs/architecture.md §5). Rows are sequences; the n completions of a prompt
sit in consecutive rows (B = num_groups * n). ``token_rewards`` carries the outcome reward on the last valid
token of each row, minus any per-token KL penalty (``kl.apply_kl_penalty``), so:
- outcome estimators (grpo, rloo, opo, gpg, reinforce_pp_baseline) use R_i = Σ_t m_t r_t, one number per
  completion, and broadcast their advantage over the completion's valid tokens;
- token estimators (reinforce_pp, remax) use the return-to-go G_t = Σ_{s≥t} γ^(s-t) r_s of each token.

Formulas and conventions follow verl ``verl/trainer/ppo/core_algos.py`` (docs/algorithms.md §1),
because users compare curves against verl:
- a group std is the unbiased one (N-1), and eps is added to the std, not the variance, so an all-equal group
  gives exactly 0 (0 / eps), never NaN;
- a singleton group (n == 1) has no baseline: mean 0 (and std 1 for GRPO), so A = R;
- "whitening" (reinforce_pp, reinforce_pp_baseline, GAE) is over ALL valid tokens of the batch passed in:
  (x - mean) / sqrt(var + 1e-8) with the unbiased variance, as verl's ``masked_whiten``. The learner therefore
  calls ``compute_token_advantages`` once on the whole optimizer step, never per micro-batch.
One deliberate difference: where the loss mask has holes inside a row (tool output between two turns), the
return-to-go skips the masked positions (no reward, no discount step) instead of restarting at them, so the
final reward still reaches the earlier turns. For a contiguous mask this is exactly verl's result.

Masked positions may hold garbage (NaN, inf): they are replaced by 0 before any arithmetic (``torch.where``,
not ``* mask``). Advantages never carry gradient.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.algos.losses_seq import sppo_loss
from asyncrl.algos.registry import SPPO_TARGETS, keyword_defaults

WHITEN_EPS = 1e-8
"""Added to the variance before the square root when whitening (verl ``masked_whiten``)."""


@dataclass
class AdvantageInputs:
    token_rewards: Tensor
    """[B, T] outcome reward on the last valid token of each row, minus any per-token KL penalty; 0 off-mask."""
    loss_mask: Tensor
    """[B, T] 1 on generated tokens that train, 0 elsewhere."""
    group_size: int
    """n: completions per prompt, in consecutive rows."""
    baseline_rewards: Tensor | None = None
    """[num_groups] reward of one greedy completion per prompt (remax only)."""

    def __post_init__(self):
        if self.token_rewards.dim() != 2 or self.token_rewards.shape != self.loss_mask.shape:
            raise ValueError(f"token_rewards and loss_mask must both be [B, T], got {tuple(self.token_rewards.shape)}"
                             f" and {tuple(self.loss_mask.shape)}")
        if self.group_size < 1 or self.token_rewards.shape[0] % self.group_size != 0:
            raise ValueError(f"batch of {self.token_rewards.shape[0]} rows does not split into groups of "
                             f"group_size={self.group_size} consecutive rows")
        num_groups = self.token_rewards.shape[0] // self.group_size
        if self.baseline_rewards is not None and tuple(self.baseline_rewards.shape) != (num_groups,):
            raise ValueError(f"baseline_rewards must be [num_groups] = [{num_groups}], "
                             f"got {tuple(self.baseline_rewards.shape)}")


def compute_grpo_advantages(rewards: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-normalised advantages per completion; Dr.GRPO (arXiv 2503.20783) when ``norm_by_std`` is False.

    rewards [num_groups, n] -> advantages [num_groups, n].
    A = (R - mean_group R) / (std_group R + eps), or A = R - mean_group R without std normalisation; Dr.GRPO
    drops the std because it up-weights groups that are nearly all right or all wrong.
    """
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


# Helpers ----------------------------------------------------------------------------------------------------
def _valid_rewards(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(valid [B, T] bool, token rewards [B, T] detached, at least fp32, 0 off-mask)."""
    valid = inputs.loss_mask.bool()
    dtype = torch.promote_types(inputs.token_rewards.dtype, torch.float32)
    rewards = inputs.token_rewards.detach().to(dtype)
    return valid, torch.where(valid, rewards, torch.zeros_like(rewards))


def _outcome_rewards(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(valid [B, T], R [num_groups, n]): each completion's summed reward, grouped."""
    valid, rewards = _valid_rewards(inputs)
    return valid, rewards.sum(dim=-1).view(-1, inputs.group_size)


def _broadcast(advantages: Tensor, valid: Tensor) -> Tensor:
    """One advantage per completion ([num_groups, n]) -> the same value on each of its valid tokens [B, T]."""
    per_row = advantages.reshape(-1, 1).expand_as(valid)  # [B, T]
    return torch.where(valid, per_row, torch.zeros_like(per_row))


def _group_mean(rewards: Tensor) -> Tensor:
    """[num_groups, n] -> [num_groups, 1]; 0 for singleton groups (no baseline, verl)."""
    if rewards.shape[1] == 1:
        return torch.zeros_like(rewards)
    return rewards.mean(dim=1, keepdim=True)


def whiten_over_valid_tokens(values: Tensor, valid: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over all valid tokens of the batch (verl ``masked_whiten``); 0 off-mask.

    The variance is the unbiased one (N - 1). With fewer than two valid tokens the spread is undefined: the
    result is 0 there rather than the NaN of verl's division by N - 1 = 0.
    """
    zeros = torch.zeros_like(values)
    values = torch.where(valid, values, zeros)  # [B, T]
    count = valid.sum().to(values.dtype)
    mean = values.sum() / count.clamp(min=1.0)
    centred = torch.where(valid, values - mean, zeros)
    var = centred.square().sum() / (count - 1.0).clamp(min=1.0)
    return centred * torch.rsqrt(var + WHITEN_EPS)


def compute_returns_to_go(token_rewards: Tensor, valid: Tensor, gamma: float) -> Tensor:
    """G_t = Σ_{s≥t, s valid} γ^(#valid tokens from t to s, exclusive of t) r_s on valid tokens, 0 elsewhere.

    token_rewards, valid: [B, T]. Masked positions are skipped (no reward, no discount step), so a reward after
    a tool-output gap still reaches the tokens before it; with γ = 1 this is a plain reverse cumulative sum.
    """
    rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))  # [B, T]
    if gamma == 1.0:
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])  # [B]
        for t in reversed(range(rewards.shape[1])):
            running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
            returns[:, t] = running
    return torch.where(valid, returns, torch.zeros_like(returns))


# Estimators (the ADVANTAGES registry) ----------------------------------------------------------------------
# Common signature: (inputs, *, norm_by_std, gamma, eps) -> [B, T]. An estimator ignores the knobs it has no use
# for; compute_token_advantages rejects gamma != 1 for the estimators that do not discount.
def compute_grpo_token_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True, gamma: float = 1.0,
                                  eps: float = 1e-6) -> Tensor:
    """GRPO (§1.2) / Dr.GRPO (§1.3, ``norm_by_std=False``), broadcast over each completion's tokens."""
    valid, rewards = _outcome_rewards(inputs)
    return _broadcast(compute_grpo_advantages(rewards, norm_by_std=norm_by_std, eps=eps), valid)


def compute_rloo_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True, gamma: float = 1.0,
                            eps: float = 1e-6) -> Tensor:
    """RLOO (arXiv 2402.14740, §1.7): A_i = R_i - mean_{j≠i} R_j = n/(n-1) (R_i - mean_group R).

    The leave-one-out baseline does not depend on R_i, so the estimate is unbiased; Σ_group A = 0.
    """
    if inputs.group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 (the baseline is the other samples), got {inputs.group_size}")
    valid, rewards = _outcome_rewards(inputs)
    n = inputs.group_size
    return _broadcast((rewards - rewards.mean(dim=1, keepdim=True)) * (n / (n - 1)), valid)


def compute_reinforce_pp_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True, gamma: float = 1.0,
                                    eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (arXiv 2501.03262, §1.8): return-to-go with discount γ, whitened over the whole batch.

    No group baseline: the global whitening is the baseline, which is why it works with n = 1 too.
    """
    valid, rewards = _valid_rewards(inputs)
    return whiten_over_valid_tokens(compute_returns_to_go(rewards, valid, gamma), valid)


def compute_reinforce_pp_baseline_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True,
                                             gamma: float = 1.0, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline (§1.8): R_i - mean_group R, broadcast, then whitened over all valid tokens.

    Centring per group removes the prompt's difficulty; scaling by the batch (not group) std avoids GRPO's
    up-weighting of near-unanimous groups.
    """
    valid, rewards = _outcome_rewards(inputs)
    return whiten_over_valid_tokens(_broadcast(rewards - _group_mean(rewards), valid), valid)


def compute_opo_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True, gamma: float = 1.0,
                           eps: float = 1e-6) -> Tensor:
    """OPO (arXiv 2505.23585, §1.13): A_i = R_i - b with the length-weighted baseline b = Σ_j |y_j| R_j / Σ_j |y_j|.

    |y_j| is the number of valid tokens of completion j. Under a token-sum loss this is the baseline that
    minimises the gradient variance. Singleton group: b = 0 (verl). A group with no valid token gets b = 0.
    """
    valid, rewards = _outcome_rewards(inputs)
    lengths = valid.sum(dim=-1).to(rewards.dtype).view_as(rewards)  # [num_groups, n]
    baseline = (lengths * rewards).sum(dim=1, keepdim=True) / lengths.sum(dim=1, keepdim=True).clamp(min=1.0)
    if inputs.group_size == 1:
        baseline = torch.zeros_like(baseline)
    return _broadcast(rewards - baseline, valid)


def compute_gpg_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True, gamma: float = 1.0,
                           eps: float = 1e-6) -> Tensor:
    """GPG (arXiv 2504.02546, §1.10): A_i = α (R_i - mean_group R) / F_norm, F_norm = 1, no std.

    α = B / max(1, #{i in the batch: R_i ≠ 0}), B = all rows of the batch, as in verl
    ``verl/trainer/ppo/core_algos.py::compute_gpg_outcome_advantage`` (volcengine/verl@012be9d9:
    ``alpha = bsz / torch.count_nonzero(scores).clamp(min=1)``). It scales the step back up when most samples
    carry no reward signal. The paper's own definition of α was not re-checked (docs/algorithms.md §1.10).
    """
    valid, rewards = _outcome_rewards(inputs)
    alpha = rewards.numel() / torch.count_nonzero(rewards).clamp(min=1).to(rewards.dtype)
    return _broadcast(alpha * (rewards - _group_mean(rewards)), valid)


def compute_remax_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True, gamma: float = 1.0,
                             eps: float = 1e-6) -> Tensor:
    """ReMax (arXiv 2310.10505, §1.9): A_t = Σ_{s≥t} r_s - R(x, greedy completion), undiscounted (verl).

    The baseline is the reward of one greedy decode of the same prompt, so it needs no group and no critic.
    """
    if inputs.baseline_rewards is None:
        raise ValueError("remax needs baseline_rewards: the reward of one greedy completion per prompt")
    valid, rewards = _valid_rewards(inputs)
    returns = compute_returns_to_go(rewards, valid, 1.0)  # [B, T]
    baseline = inputs.baseline_rewards.detach().to(returns.dtype).repeat_interleave(inputs.group_size)  # [B]
    advantages = returns - baseline[:, None]
    return torch.where(valid, advantages, torch.zeros_like(advantages))


def compute_grpo_passk_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True, gamma: float = 1.0,
                                  eps: float = 1e-6) -> Tensor:
    """GRPO's pass@k advantage (arXiv 2503.19595; verl ``compute_grpo_passk_outcome_advantage``): only the best
    completion of each group learns, with A = R_max - R_second, divided by the group's (unbiased) std + eps when
    ``norm_by_std``; every other completion gets 0. It rewards the one sample that would make pass@k, not the
    group's average. Ties give the first best 0 (R_max = R_second)."""
    if inputs.group_size < 2:
        raise ValueError(f"grpo_passk needs group_size >= 2 (the best against the second best), got "
                         f"{inputs.group_size}")
    valid, rewards = _outcome_rewards(inputs)
    top2 = rewards.topk(2, dim=1).values  # [num_groups, 2]
    gap = top2[:, 0] - top2[:, 1]  # [num_groups]
    if norm_by_std:
        gap = gap / (rewards.std(dim=1, unbiased=True) + eps)
    advantages = torch.zeros_like(rewards)
    advantages.scatter_(1, rewards.argmax(dim=1, keepdim=True), gap[:, None])
    return _broadcast(advantages, valid)


def bradley_terry_win_rates(scores: Tensor) -> Tensor:
    """Each completion's win rate against its prompt's group under the Bradley–Terry preference of a reward model:
    P(y_i ≻ y_j) = σ(r_i - r_j), P̂_i = (1/n) Σ_j P(y_i ≻ y_j), j over the whole group, i itself included (σ(0) = ½).

    scores [num_groups, n] -> win rates [num_groups, n] in (0, 1), each group's mean exactly ½ (the pairs cancel:
    σ(d) + σ(-d) = 1). This is SPPO's P̂(y ≻ π_t | x) (arXiv 2405.00675, §3) with the n samples standing for π_t,
    as its code computes it from a ranker's scores (the full n x n matrix, diagonal included). Only differences of
    scores matter: a reward model's offset changes nothing, its scale sets how sure each preference is.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [num_groups, n], got shape {tuple(scores.shape)}")
    return torch.sigmoid(scores[:, :, None] - scores[:, None, :]).mean(dim=2)


def compute_sppo_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True, gamma: float = 1.0,
                            eps: float = 1e-6, eta: float, target: str = "softmean") -> Tensor:
    """SPPO's target per completion (arXiv 2405.00675, §1.17). ``target="softmean"`` (verl's recipe, verifiable
    rewards): s_i = R_i - SM_η(R_group), with the soft-mean SM_η(R) = (1/η) log mean_j exp(η R_j) over the prompt's
    group, so that η s_i = η R_i - log E_{π_t}[exp(η R)] is the log-ratio of the multiplicative-weights step
    π_{t+1} ∝ π_t exp(η R) (the sppo loss regresses onto it). ``target="bradley_terry"`` (the paper's, the rewards
    a reward model's scores): s_i = P̂_i - ½, P̂_i the completion's win rate against its group
    (``bradley_terry_win_rates``); the paper's step is π_{t+1} ∝ π_t exp(η P̂), whose log-normaliser is η/2 when
    the n samples stand for π_t (P̂ averages ½ over them).

    Per prompt, where verl's recipe takes the soft-mean over the whole batch (its rollout.n = 1): log Z of that
    step is the prompt's, so a baseline from other prompts mixes their difficulty into each sample's target. A
    lone completion (n = 1) has s = 0. No std normalisation: the target's scale is η's. η must be the loss's
    (compute_token_advantages fills in the sppo loss's default).
    """
    if not eta > 0:
        raise ValueError(f"sppo's eta must be > 0, got {eta}")
    if target not in SPPO_TARGETS:
        raise ValueError(f"unknown sppo target {target!r}; choose one of {SPPO_TARGETS}")
    valid, rewards = _outcome_rewards(inputs)  # [num_groups, n]
    if target == "bradley_terry":
        return _broadcast(bradley_terry_win_rates(rewards) - 0.5, valid)
    soft_mean = (torch.logsumexp(eta * rewards, dim=1, keepdim=True) - math.log(rewards.shape[1])) / eta
    return _broadcast(rewards - soft_mean, valid)


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": compute_grpo_token_advantages,
    "grpo_passk": compute_grpo_passk_advantages,
    "rloo": compute_rloo_advantages,
    "reinforce_pp": compute_reinforce_pp_advantages,
    "reinforce_pp_baseline": compute_reinforce_pp_baseline_advantages,
    "opo": compute_opo_advantages,
    "gpg": compute_gpg_advantages,
    "remax": compute_remax_advantages,
    "sppo": compute_sppo_advantages,
}

DISCOUNTED_ADVANTAGES = frozenset({"reinforce_pp"})
"""Estimators that read ``gamma``; the others raise on gamma != 1 rather than silently ignore it."""


def compute_token_advantages(name: str, inputs: AdvantageInputs, *, norm_by_std: bool = True,
                             gamma: float = 1.0, eps: float = 1e-6, eta: float | None = None,
                             sppo_target: str = "softmean") -> Tensor:
    """Advantages [B, T] (0 off-mask, no gradient) of estimator ``name`` over the whole optimizer-step batch.

    ``norm_by_std``: grpo only (False = Dr.GRPO). ``gamma``: per-token discount, reinforce_pp only.
    ``eps``: added to the group std (grpo). Defaults are verl's (norm_adv_by_std_in_grpo=True, gamma=1.0,
    epsilon=1e-6). ``eta``: sppo's soft-mean temperature (the sppo loss's η; None: its default), sppo only.
    ``sppo_target``: what sppo reads the rewards as (``SPPO_TARGETS``), sppo only.
    """
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGES)}")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if gamma != 1.0 and name not in DISCOUNTED_ADVANTAGES:
        raise ValueError(f"gamma={gamma} has no effect on advantage {name!r}; only "
                         f"{sorted(DISCOUNTED_ADVANTAGES)} discount")
    if eta is not None and name != "sppo":
        raise ValueError(f"eta is sppo's soft-mean temperature; advantage {name!r} does not read it")
    if sppo_target != "softmean" and name != "sppo":
        raise ValueError(f"sppo_target is sppo's; advantage {name!r} does not read it")
    if name == "sppo":
        eta = keyword_defaults(sppo_loss)["eta"] if eta is None else eta  # one η, written once: the loss's
        return compute_sppo_advantages(inputs, norm_by_std=norm_by_std, gamma=gamma, eps=eps, eta=eta,
                                       target=sppo_target)
    return ADVANTAGES[name](inputs, norm_by_std=norm_by_std, gamma=gamma, eps=eps)


def compute_gae_advantages(token_rewards: Tensor, values: Tensor, loss_mask: Tensor, *, gamma: float = 1.0,
                           lam: float = 1.0, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2015, §1.14) on a critic's values: (advantages [B, T], returns [B, T]), 0 off-mask.

    δ_t = r_t + γ V_{t+1} - V_t,  Â_t = δ_t + γλ Â_{t+1},  returns = Â + V (before whitening), as verl
    ``compute_gae_advantage_return``, which also whitens Â over the batch (``whiten=True``). Masked positions
    (tool output, padding) are skipped: the next value and the running Â carry over them unchanged. After the
    last valid token V = 0 (terminal). Not in ``ADVANTAGES``, whose estimators read rewards only: the learner calls
    it with its critic's values (algo.advantage=gae, learner/train_step.py::compute_advantages).
    """
    valid = loss_mask.bool()  # [B, T]
    dtype = torch.promote_types(token_rewards.dtype, torch.float32)
    zeros = torch.zeros(valid.shape, dtype=dtype, device=token_rewards.device)
    rewards = torch.where(valid, token_rewards.detach().to(dtype), zeros)
    values = torch.where(valid, values.detach().to(dtype), zeros)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # [B]
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(valid[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = running
    advantages = torch.where(valid, advantages, zeros)
    returns = torch.where(valid, advantages + values, zeros)
    if whiten:
        advantages = whiten_over_valid_tokens(advantages, valid)
    return advantages, returns
