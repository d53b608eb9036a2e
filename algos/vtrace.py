"""V-trace (IMPALA, Espeholt et al. 2018, arXiv 1802.01561; docs/algorithms.md §2.1), written from the paper's
equations, and its LLM wrapper.

With ρ_t = min(ρ̄, π_t/μ_t), c_t = min(c̄, π_t/μ_t) and δ_t = ρ_t (r_t + γ_t V_{t+1} - V_t):
    v_s = V_s + Σ_{t>=s} (Π_{i=s}^{t-1} γ_i c_i) δ_t,
    computed backwards as  v_s = V_s + δ_s + γ_s c_s (v_{s+1} - V_{s+1})  (v_T = V_T, the bootstrap),
    policy-gradient advantage  A_s = ρ^pg_s (r_s + γ_s v_{s+1} - V_s),  ρ^pg_s = min(ρ̄_pg, π_s/μ_s).
ρ̄ chooses the fixed point (the value of π_ρ̄ ∝ min(ρ̄ μ, π); V^π as ρ̄ -> ∞), c̄ only how fast traces are cut.
Defaults ρ̄ = ρ̄_pg = c̄ = 1 are IMPALA's (scalable_agent's thresholds 1.0; c̄ hard-coded to 1 there).

Layout: BATCH-major, [B, T] with time last, like every other tensor in ``algos`` (not IMPALA's time-major [T, B]).
The recursion is a Python loop over T of [B]-wide operations: exact for any c (a cumulative-product closed form
divides by Π c, which is 0 as soon as one trace is cut).
"""
import torch
from torch import Tensor

from asyncrl.algos.log_ratio import LOG_RATIO_CLAMP, masked_log_ratio


@torch.no_grad()
def compute_vtrace(
    log_rhos: Tensor,
    discounts: Tensor,
    rewards: Tensor,
    values: Tensor,
    bootstrap_value: Tensor,
    *,
    clip_rho: float | None = 1.0,
    clip_pg_rho: float | None = 1.0,
    clip_c: float | None = 1.0,
) -> tuple[Tensor, Tensor]:
    """V-trace targets and policy-gradient advantages, both [B, T] (batch-major), detached.

    log_rhos [B, T] = log π(a_t|x_t) - log μ(a_t|x_t); discounts [B, T] = γ_t (0 where x_{t+1} is terminal);
    rewards [B, T] = r_t; values [B, T] = V(x_t); bootstrap_value [B] = V(x_T). A clip of None means no clipping.
    Returns (vs, pg_advantages): vs regresses the critic, pg_advantages multiplies ∇log π(a_s|x_s).
    log_rhos is clamped ABOVE only, to LOG_RATIO_CLAMP (a +inf ratio would make 0·inf = NaN when unclipped): a -inf
    here gives ρ = c = 0 exactly and cuts the trace. ``compute_vtrace_advantages`` passes log-ratios already clamped
    to ±LOG_RATIO_CLAMP, where such a token gets ρ = e^-20 ≈ 2e-9, which cuts the trace just the same.
    """
    if not (log_rhos.shape == discounts.shape == rewards.shape == values.shape) or log_rhos.dim() != 2:
        raise ValueError("log_rhos, discounts, rewards and values must all be [B, T]")
    if bootstrap_value.shape != log_rhos.shape[:1]:
        raise ValueError(f"bootstrap_value must be [B] = {tuple(log_rhos.shape[:1])}, "
                         f"got {tuple(bootstrap_value.shape)}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    rhos = torch.exp(log_rhos.to(dtype).clamp(max=LOG_RATIO_CLAMP))  # [B, T]
    clipped_rhos = rhos if clip_rho is None else rhos.clamp(max=clip_rho)
    cs = rhos if clip_c is None else rhos.clamp(max=clip_c)
    pg_rhos = rhos if clip_pg_rho is None else rhos.clamp(max=clip_pg_rho)
    discounts, rewards, values = discounts.to(dtype), rewards.to(dtype), values.to(dtype)
    bootstrap = bootstrap_value.to(dtype)[:, None]  # [B, 1]

    values_next = torch.cat([values[:, 1:], bootstrap], dim=1)  # V(x_{t+1}), [B, T]
    deltas = clipped_rhos * (rewards + discounts * values_next - values)  # δ_t V
    vs_minus_v = torch.empty_like(values)
    acc = torch.zeros_like(bootstrap[:, 0])  # v_T - V(x_T) = 0: the bootstrap is taken as is
    for t in reversed(range(values.shape[1])):
        acc = deltas[:, t] + discounts[:, t] * cs[:, t] * acc
        vs_minus_v[:, t] = acc
    vs = values + vs_minus_v
    vs_next = torch.cat([vs[:, 1:], bootstrap], dim=1)  # v_{s+1}, with v_T = V(x_T)
    pg_advantages = pg_rhos * (rewards + discounts * vs_next - values)
    return vs, pg_advantages


def _compact_valid_left(valid: Tensor) -> Tensor:
    """[B, T] permutation per row that puts the valid positions first, in their order (masked ones after)."""
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    return torch.argsort((~valid).long() * valid.shape[1] + positions, dim=1)


@torch.no_grad()
def compute_vtrace_advantages_and_targets(
    logprobs_target: Tensor,
    logprobs_behav: Tensor,
    loss_mask: Tensor,
    seq_rewards: Tensor,
    values: Tensor | None = None,
    *,
    clip_rho: float | None = 1.0,
    clip_pg_rho: float | None = 1.0,
    clip_c: float | None = 1.0,
) -> tuple[Tensor, Tensor]:
    """V-trace policy-gradient advantages [B, T] for LLM batches (0 off-mask), ρ^pg already included, and the
    V-trace targets v_s [B, T] (0 off-mask), which regress a critic (algo.vtrace_values=critic).

    Each valid token is one step (masked tokens, e.g. tool output inside a trajectory, are skipped, not steps);
    γ = 1; the sequence reward ``seq_rewards`` [B] is the reward of the last valid token, and the episode ends
    there (no bootstrap). ``values`` None means critic-free (V = 0): v_s is then the suffix-truncated sequence IS
    estimate (Π_{i=s}^{T-1} c_i) ρ_T R; ``values`` [B, T] is a baseline V(x_t) on the valid tokens.
    ``logprobs_target`` is π (the learner's, detached), ``logprobs_behav`` μ. The result is the whole IS-corrected
    advantage: pair it with a ratio-free loss (reinforce) and no other correction, or it corrects twice.
    On-policy it reduces to A_t = R - V_t on every token (A = R without a critic). log ρ is ``masked_log_ratio``:
    -inf - -inf at padding never leaks, a NaN on a valid token counts as ρ = 1, and a token π would never sample
    (ℓπ = -inf) gets ρ = e^-20.
    """
    valid = loss_mask.bool()  # [B, T]
    log_rhos = masked_log_ratio(logprobs_target, logprobs_behav, valid)  # [B, T]
    dtype = log_rhos.dtype
    values = torch.zeros_like(log_rhos) if values is None else torch.where(valid, values.to(dtype), 0.0)

    order = _compact_valid_left(valid)  # step j of row b is position order[b, j]
    steps = torch.arange(valid.shape[1], device=valid.device)[None, :]
    num_steps = valid.sum(dim=-1, keepdim=True)  # [B, 1]
    is_step = steps < num_steps  # [B, T] in step order
    is_last = steps == num_steps - 1
    zeros = torch.zeros_like(log_rhos)
    vs, pg_advantages = compute_vtrace(
        log_rhos=torch.where(is_step, log_rhos.gather(1, order), zeros),
        discounts=torch.where(is_step & ~is_last, torch.ones_like(zeros), zeros),
        rewards=torch.where(is_last, seq_rewards.to(dtype)[:, None].expand_as(zeros), zeros),
        values=torch.where(is_step, values.gather(1, order), zeros),
        bootstrap_value=zeros[:, 0],
        clip_rho=clip_rho, clip_pg_rho=clip_pg_rho, clip_c=clip_c)
    advantages = torch.zeros_like(zeros).scatter_(1, order, torch.where(is_step, pg_advantages, zeros))
    advantages = torch.where(valid, advantages, zeros)
    targets = torch.zeros_like(zeros).scatter_(1, order, torch.where(is_step, vs, zeros))
    return advantages, torch.where(valid, targets, zeros)


def compute_vtrace_advantages(
    logprobs_target: Tensor,
    logprobs_behav: Tensor,
    loss_mask: Tensor,
    seq_rewards: Tensor,
    values: Tensor | None = None,
    *,
    clip_rho: float | None = 1.0,
    clip_pg_rho: float | None = 1.0,
    clip_c: float | None = 1.0,
) -> Tensor:
    """The advantages of ``compute_vtrace_advantages_and_targets`` alone (no critic to regress)."""
    advantages, _ = compute_vtrace_advantages_and_targets(logprobs_target, logprobs_behav, loss_mask, seq_rewards,
                                                          values, clip_rho=clip_rho, clip_pg_rho=clip_pg_rho,
                                                          clip_c=clip_c)
    return advantages
