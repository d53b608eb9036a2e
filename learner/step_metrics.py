"""The step's batch-level metrics: off-policyness, staleness, correction statistics, rewards and entropy.

These are computed once per step on the whole batch (not per micro-batch), because several of them are
per-sequence or batch-global (χ² per sequence, perplexity ratio, ESS, the staleness histogram). π_prox here is
what the loss actually used, put back together from the micro-batches. Which correction's statistics are reported
is the plan's `batch_metrics_correction`.
"""
import logging

import torch

from asyncrl.algos.corrections import compute_correction
from asyncrl.algos.metrics import compute_mult_prob_error, compute_offpolicy_metrics, compute_staleness_metrics
from asyncrl.algos.offpolicy_plan import OffPolicyPlan
from asyncrl.learner.batch import Batch

log = logging.getLogger(__name__)
MULT_PROB_ERROR_ALERT = 1.05
"""NeMo-RL's threshold for offpolicy/token_mult_prob_error on tokens the learner's own weights sampled."""


def collect_step_metrics(batch: Batch, groups: list, plan: OffPolicyPlan, settings, prox: torch.Tensor,
                         entropy: torch.Tensor, correction_metrics: dict | None,
                         step_start: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """Every batch-level metric of the step. ``correction_metrics``: those of a batch-global correction, already
    computed on the whole batch (None: computed here, from ``prox``, when the plan has a correction weight).
    ``step_start``: (the learner's logprobs with the step-start weights [B, T], a [B] mask of the rows they cover),
    for the framework-mismatch alert; None: no such rows."""
    mask = batch.loss_mask
    valid = mask.bool()
    tokens = float(mask.sum())
    metrics = {**compute_offpolicy_metrics(prox, batch.logprobs_behav, mask),
               **compute_staleness_metrics(batch.versions, mask, settings.version, settings.max_staleness),
               **mult_prob_error_metrics(batch, settings.version, step_start)}
    if correction_metrics is None and plan.batch_metrics_correction is not None:
        _, correction_metrics = compute_correction(plan.batch_metrics_correction, prox, batch.logprobs_behav, mask,
                                                   **plan.weight_kwargs)
    # `_sum` numerators exist to combine micro-batches; this call already saw the whole batch
    metrics.update({key: float(value) for key, value in (correction_metrics or {}).items()
                    if not key.endswith("_sum")})
    # one reward per episode: per-turn samples (rollout.turn_samples) repeat theirs on every turn
    rewards = torch.tensor([r for group in groups for r in group.episode_rewards()], dtype=torch.float64)
    per_group = rewards.view(len(groups), -1)
    advantages = batch.advantages[valid].double()
    metrics.update({
        "policy/entropy": float(entropy[valid].mean()) if tokens else 0.0,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/frac_zero_std_groups": float((per_group.max(-1).values == per_group.min(-1).values).double().mean()),
        "advantage/mean": float(advantages.mean()) if tokens else 0.0,
        "advantage/std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "rollout/len_tokens/mean": tokens / max(rewards.numel(), 1),
    })
    if plan.greedy_baseline:
        metrics["reward/greedy_baseline/mean"] = sum(float(g.meta["baseline_reward"]) for g in groups) / len(groups)
    return metrics


def component_means(groups, names) -> dict:
    """`reward/<name>/mean` for each reward.functions component in `names` (reward_info["reward/<name>"]), over
    the samples that carry it (a failed reward call carries none). Only the configured names: reward_info comes
    from generators, and keys of their choosing must not become metrics."""
    keys = {f"reward/{name}" for name in names}
    sums: dict = {}
    for group in groups:
        for sample in group.samples:
            for key, value in sample.reward_info.items():
                if key in keys:
                    total, count = sums.get(key, (0.0, 0))
                    sums[key] = (total + value, count + 1)
    return {f"{key}/mean": total / count for key, (total, count) in sorted(sums.items())}


def mult_prob_error_metrics(batch: Batch, version: int, step_start) -> dict:
    """offpolicy/token_mult_prob_error over every trained token the step-start pass covers, and /fresh over those
    the learner's own version sampled (where it is a pure framework check, compute_mult_prob_error), with the
    fraction of such tokens (/fresh_frac; 0 when every token is stale, and then /fresh reads 1.0)."""
    valid = batch.loss_mask.bool()
    if step_start is None:
        return {"offpolicy/token_mult_prob_error": 1.0, "offpolicy/token_mult_prob_error/fresh": 1.0,
                "offpolicy/token_mult_prob_error/fresh_frac": 0.0}
    logprobs, rows = step_start
    covered = valid & rows[:, None]
    fresh = covered & (batch.versions == version)
    return {
        "offpolicy/token_mult_prob_error": compute_mult_prob_error(logprobs, batch.logprobs_behav, covered),
        "offpolicy/token_mult_prob_error/fresh": compute_mult_prob_error(logprobs, batch.logprobs_behav, fresh),
        "offpolicy/token_mult_prob_error/fresh_frac": float(fresh.sum()) / max(float(valid.sum()), 1.0),
    }


def warn_on_mismatch(metrics: dict, step: int, per_generator: dict | None = None) -> bool:
    """Log a warning when the learner and the engine disagree on tokens the learner's own weights sampled by more
    than MULT_PROB_ERROR_ALERT: that is a framework bug (sampling settings, tokens, weights), not staleness.
    `step`: the step just trained (the version it made, as the progress log numbers it); `per_generator`: each
    generator's mean |behaviour - learner logprob| in this batch, so the line names the one at fault
    (learner/trust.py). Returns whether it warned."""
    value = metrics.get("offpolicy/token_mult_prob_error/fresh", 1.0)
    if value <= MULT_PROB_ERROR_ALERT:
        return False
    named = ", ".join(f"{gen} {mean:.3f}" for gen, mean in (per_generator or {}).items())
    log.warning("step %d: offpolicy/token_mult_prob_error = %.4f on tokens sampled by the learner's own weights "
                "(alert above %.2f): the engine's logprobs do not match the learner's. That is a bug, not "
                "staleness: check rollout.top_p/top_k, the sampling temperature, the dtypes, and that weight "
                "updates reach the engine%s", step, value, MULT_PROB_ERROR_ALERT,
                f"; mean |behaviour - learner logprob| by generator (nats): {named}" if named else "")
    return True
