"""The step's batch-level metrics: off-policyness, staleness, correction statistics, rewards and entropy.

These are computed once per step on the whole batch (not per micro-batch), because several of them are
per-sequence or batch-global (χ² per sequence, perplexity ratio, ESS, the staleness histogram). π_prox here is
what the loss actually used, put back together from the micro-batches. Which correction's statistics are reported
is the plan's `batch_metrics_correction`.
"""
import torch

from asyncrl.algos.corrections import compute_correction
from asyncrl.algos.metrics import compute_offpolicy_metrics, compute_staleness_metrics
from asyncrl.algos.plan import OffPolicyPlan
from asyncrl.learner.batch import Batch


def collect_step_metrics(batch: Batch, groups: list, algo, plan: OffPolicyPlan, settings, prox: torch.Tensor,
                         entropy: torch.Tensor, correction_metrics: dict | None) -> dict:
    """Every batch-level metric of the step. ``correction_metrics``: those of a batch-global correction, already
    computed on the whole batch (None: computed here, from ``prox``, when the plan has a correction weight)."""
    mask = batch.loss_mask
    valid = mask.bool()
    tokens = float(mask.sum())
    metrics = {**compute_offpolicy_metrics(prox, batch.logprobs_behav, mask),
               **compute_staleness_metrics(batch.versions, mask, settings.version, settings.max_staleness)}
    if correction_metrics is None and plan.batch_metrics_correction is not None:
        _, correction_metrics = compute_correction(plan.batch_metrics_correction, prox, batch.logprobs_behav, mask,
                                                   **plan.weight_kwargs)
    # `_sum` numerators exist to combine micro-batches; this call already saw the whole batch
    metrics.update({key: float(value) for key, value in (correction_metrics or {}).items()
                    if not key.endswith("_sum")})
    rewards = torch.tensor([r for group in groups for r in group.rewards()], dtype=torch.float64)
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
    if algo.advantage == "remax":
        metrics["reward/greedy_baseline/mean"] = sum(float(g.meta["baseline_reward"]) for g in groups) / len(groups)
    return metrics
