"""PRIME (arXiv 2502.01456, docs/algorithms.md §1.12): process rewards from an implicit PRM, trained online.

The implicit PRM π_φ is a causal LM like the policy; its process reward for token t is β log(π_φ(y_t)/π_ref(y_t)),
π_ref the frozen model both start from. It learns from outcome labels only: the sequence's summed log-ratio is read
as a logit, σ(β Σ_t q_t), and fitted to the verifier's reward with binary cross-entropy, so that the per-token terms
come to credit the tokens that made the answer right. The policy's advantage combines those token rewards with the
outcome reward, each through a leave-one-out baseline over the prompt's group, then sums the return-to-go and
whitens over the batch (verl's recipe, `recipe/prime/prime_core_algos.py::compute_rloo_advantage_return`,
`compute_ce_dpo_loss_rm`, `prime_dp_rm.py`).

Pure functions over [B, T] tensors whose rows are completions, the n of a prompt in consecutive rows; masked
positions may hold garbage and are replaced by 0 first. The learner's side (the PRM's passes and optimizer) is
learner/prm.py.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl.algos.advantages import compute_returns_to_go, whiten_over_valid_tokens

BATCH_NORM_EPS = 1e-6
"""Added to the largest |return| before dividing by it (verl's prime_norm=batch_norm)."""


def _masked(values: Tensor, valid: Tensor) -> Tensor:
    values = values.detach().to(torch.promote_types(values.dtype, torch.float32))
    return torch.where(valid, values, torch.zeros_like(values))


def implicit_process_rewards(log_ratio: Tensor, loss_mask: Tensor, beta: float, norm: str = "batch_norm") -> Tensor:
    """The PRM's token rewards r_t = β q_t, q_t = log π_φ(y_t) - log π_ref(y_t), [B, T], 0 off-mask.

    `norm="batch_norm"` (verl's default) divides every reward by the largest |Σ_{s≥t} r_s| of the batch (+1e-6), so
    no token's return-to-go from the PRM exceeds 1 in size: the PRM's scale then never swamps the outcome term,
    however far π_φ drifts from π_ref. "none" keeps β q as it is.
    """
    if norm not in ("batch_norm", "none"):
        raise ValueError(f"PRIME's norm must be 'batch_norm' or 'none', got {norm!r}")
    valid = loss_mask.bool()
    rewards = beta * _masked(log_ratio, valid)
    if norm == "batch_norm":
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
        rewards = rewards / (returns.abs().max() + BATCH_NORM_EPS)
    return rewards


def leave_one_out(rewards: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """verl's `masked_rloo` on [B, T] rewards placed where `mask` is set: with m_i the mean of row i over its mask,
    each placed reward r becomes n/(n-1) r - Σ_{j in group} m_j / (n-1). With one placed reward per row (the outcome
    on the last token) that is R_i - mean_{j≠i} R_j, RLOO; with a reward on every token each token is measured
    against the other rows' mean token reward. A row with nothing placed has m = 0. Needs n >= 2."""
    if group_size < 2:
        raise ValueError(f"PRIME's leave-one-out baseline needs group_size >= 2, got {group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rows do not split into groups of {group_size}")
    mask = mask.bool()
    rewards = _masked(rewards, mask)
    counts = mask.sum(-1).to(rewards.dtype)  # [B]
    means = rewards.sum(-1) / counts.clamp(min=1.0)  # [B]
    baseline = means.view(-1, group_size).sum(-1, keepdim=True) / (group_size - 1)  # [num_groups, 1]
    baseline = baseline.expand(-1, group_size).reshape(-1, 1)  # [B, 1]
    placed = rewards * (group_size / (group_size - 1)) - baseline
    return torch.where(mask, placed, torch.zeros_like(placed))


def last_valid_positions(loss_mask: Tensor) -> Tensor:
    """[B, T] bool: True at each row's last position with loss_mask set (none for an empty row)."""
    valid = loss_mask.bool()
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(-1).values  # [B]
    return (positions == last[:, None]) & valid


def compute_prime_advantages(process_rewards: Tensor, outcome_rewards: Tensor, loss_mask: Tensor, group_size: int,
                             process_coef: float = 5.0, outcome_coef: float = 5.0) -> tuple[Tensor, Tensor]:
    """PRIME's (advantages, returns), both [B, T] and 0 off-mask.

    `process_rewards` [B, T]: the PRM's token rewards (implicit_process_rewards). `outcome_rewards` [B]: each
    completion's verifiable reward, placed on its last trained token. Each source goes through leave_one_out over the
    prompt's group and is weighted (verl's reward_dpo_coef and reward_gt_coef, 5 each); their sum's return-to-go
    (γ = 1, masked positions skipped) is the returns, and the returns whitened over the batch's trained tokens are the
    advantages. A coefficient of 0 leaves its source out: process_coef=0 is RLOO on the outcome, whitened.
    """
    valid = loss_mask.bool()
    if process_rewards.shape != valid.shape or tuple(outcome_rewards.shape) != (valid.shape[0],):
        raise ValueError(f"process rewards [B, T] = {tuple(valid.shape)} and outcome rewards [B] expected, got "
                         f"{tuple(process_rewards.shape)} and {tuple(outcome_rewards.shape)}")
    total = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    if process_coef != 0.0:
        total = total + process_coef * leave_one_out(process_rewards, valid, group_size)
    if outcome_coef != 0.0:
        last = last_valid_positions(valid)
        outcome = _masked(outcome_rewards, torch.ones_like(outcome_rewards, dtype=torch.bool))
        placed = torch.where(last, outcome[:, None].expand_as(total), torch.zeros_like(total))
        total = total + outcome_coef * leave_one_out(placed, last, group_size)
    returns = compute_returns_to_go(total, valid, 1.0)
    return whiten_over_valid_tokens(returns, valid), returns


def prm_loss(log_ratio: Tensor, loss_mask: Tensor, labels: Tensor, beta: float) -> Tensor:
    """Per-row binary cross-entropy [B] of the PRM: BCE(σ(β Σ_t m_t q_t), label), with gradient through `log_ratio`
    (the PRM's logprobs minus the reference's). Labels are the outcome rewards, clipped to [0, 1]: a 0/1 verifier's
    are verl's `acc`; a partial reward is a soft label. Computed from the logit (BCE with logits), which equals verl's
    σ-then-BCE without its overflow at large |β Σ q|."""
    valid = loss_mask.bool()
    summed = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(-1)  # [B]
    targets = labels.detach().to(summed.dtype).clamp(0.0, 1.0)
    return F.binary_cross_entropy_with_logits(beta * summed, targets, reduction="none")


def prm_pair_accuracy(sequence_scores: Tensor, labels: Tensor, group_size: int) -> float:
    """How often the PRM orders two completions of a prompt as their outcome does, weighted by the outcome gap (after
    verl's `compute_dpo_accuracy`): per group, Σ_pairs |ΔR| agree(Δs, ΔR) / Σ_pairs |ΔR|, where agree is 1 when the
    scores differ the way the outcomes do, 1/2 when the scores tie, 0 otherwise; 0.5 for a group whose outcomes are
    all equal; the mean over groups. `sequence_scores` [B]: Σ_t q_t per completion. verl counts a tie as agreeing
    whenever the later completion of the pair is the better one, so a PRM that has learned nothing (every score 0)
    scores by the batch's order; here it scores 0.5."""
    scores = sequence_scores.detach().double().view(-1, group_size)
    outcomes = labels.detach().double().view(-1, group_size)
    upper = torch.triu(torch.ones(group_size, group_size, dtype=torch.bool), diagonal=1)
    score_gaps = (scores[:, :, None] - scores[:, None, :])[:, upper]  # [groups, pairs]: s_i - s_j, i < j
    outcome_gaps = (outcomes[:, :, None] - outcomes[:, None, :])[:, upper]
    weight = outcome_gaps.abs()
    agree = (score_gaps * outcome_gaps > 0).double() + 0.5 * (score_gaps == 0).double()
    per_group = torch.where(weight.sum(-1) > 0, (agree * weight).sum(-1) / weight.sum(-1).clamp(min=1e-12),
                            torch.full_like(weight[:, 0], 0.5))
    return float(per_group.mean()) if per_group.numel() else 0.5
