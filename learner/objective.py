"""The loss of one micro-batch, assembled from `asyncrl.algos` and nothing else (docs/architecture.md §5).

Every off-policy choice (where π_prox comes from, which policy centres the loss ratio, which detached weight
multiplies the loss and where it is computed) is read from the run's `algos.offpolicy_plan.OffPolicyPlan`, whose
module doc has the table per correction. This module only carries those answers out for one micro-batch.
"""
from dataclasses import dataclass

import torch

from asyncrl.algos.corrections import CORRECTION_WEIGHTS, approximate_prox_logprobs, compute_correction
from asyncrl.algos.kl import compute_kl
from asyncrl.algos.loss_parts import PolicyLossInputs
from asyncrl.algos.losses import POLICY_LOSSES, aggregate_loss
from asyncrl.algos.offpolicy_plan import (CENTRE_BEHAV, PROX_FUSED, PROX_RECOMPUTE, WEIGHT_BATCH, WEIGHT_CURRENT, WEIGHT_NONE,
                                OffPolicyPlan)
from asyncrl.algos.registry import keyword_defaults


@dataclass
class StepCounts:
    """Global normalisers of one optimizer step (all its micro-batches)."""

    tokens: float
    seqs: float


def resolved_hyperparameters(algo) -> dict:
    """The loss's and correction's hyperparameters as they will be used (published defaults filled in), for the
    run's MLflow params: a null in the recipe should not hide which ε a run trained with."""
    plan = OffPolicyPlan.from_algo(algo)
    loss = {**keyword_defaults(POLICY_LOSSES[plan.loss]), **plan.loss_kwargs}
    own = CORRECTION_WEIGHTS.get(algo.correction)  # bypass, none and vtrace have no weight function of their own
    correction = {**(keyword_defaults(own) if own else {}), **algo.correction_kwargs(), **plan.weight_kwargs}
    resolved = {f"algo.resolved.{algo.loss}.{k}": str(v) for k, v in loss.items()}
    resolved.update({f"algo.resolved.{algo.correction}.{k}": str(v) for k, v in correction.items()})
    return resolved


def resolve_prox(plan: OffPolicyPlan, logprobs: torch.Tensor, micro, version: int) -> torch.Tensor:
    """π_prox logprobs [b, l] for this micro-batch, detached, from the plan's source."""
    if plan.prox_source == PROX_FUSED:
        return logprobs.detach()
    if plan.prox_source == PROX_RECOMPUTE:
        return micro.logprobs_prox
    return approximate_prox_logprobs(logprobs.detach(), micro.logprobs_behav, micro.versions, micro.loss_mask,
                                     learner_version=version)


def micro_is_weight(plan: OffPolicyPlan, logprobs: torch.Tensor, prox: torch.Tensor, micro):
    """The detached per-token weight [b, l] for this micro-batch, or None, as the plan says."""
    if plan.weight_source == WEIGHT_NONE:
        return None
    if plan.weight_source == WEIGHT_BATCH:
        return micro.is_weight  # computed once on the whole batch by the train step
    target = logprobs.detach() if plan.weight_source == WEIGHT_CURRENT else prox
    weight, _ = compute_correction(plan.weight_correction, target, micro.logprobs_behav, micro.loss_mask,
                                   **plan.weight_kwargs)
    return weight


def policy_loss_inputs(plan: OffPolicyPlan, logprobs: torch.Tensor, prox: torch.Tensor, micro,
                       generator: torch.Generator | None) -> PolicyLossInputs:
    """The typed input of the plan's loss for this micro-batch."""
    return PolicyLossInputs(
        logprobs=logprobs,
        logprobs_centre=micro.logprobs_behav if plan.centre == CENTRE_BEHAV else prox,
        advantages=micro.advantages,
        loss_mask=micro.loss_mask,
        logprobs_behav=micro.logprobs_behav,
        is_weight=micro_is_weight(plan, logprobs, prox, micro),
        generator=generator,
    )


def compute_micro_loss(plan: OffPolicyPlan, algo, logprobs: torch.Tensor, prox: torch.Tensor, micro,
                       counts: StepCounts, kl_loss_coef: float, generator: torch.Generator | None = None,
                       entropy: torch.Tensor | None = None):
    """This micro-batch's share of the step loss (a scalar with grad), its policy-loss, KL-loss and entropy-bonus
    shares (detached fp64 0-d tensors, so they sum as the floats they become, or 0.0 for a term that is off;
    summed over micro-batches they give the step's values; the caller turns them into floats once, since float()
    waits for the device) and its token metrics.
    ``algo`` supplies the aggregation, the KL estimator and ``entropy_coef``: with it > 0, ``entropy`` [b, l] (with
    grad) is aggregated like the policy loss and ``entropy_coef`` times it is subtracted (verl's entropy_coeff)."""
    inputs = policy_loss_inputs(plan, logprobs, prox, micro, generator)
    per_token, metrics = POLICY_LOSSES[plan.loss](inputs, **plan.loss_kwargs)
    agg = dict(global_tokens=counts.tokens, global_seqs=counts.seqs, norm_constant=algo.loss_norm_constant)
    pg_loss = aggregate_loss(per_token, micro.loss_mask, algo.loss_agg, **agg)
    loss, kl_share, metrics = pg_loss, 0.0, dict(metrics)
    if kl_loss_coef > 0:
        kl = compute_kl(logprobs, micro.logprobs_ref, algo.kl_loss_type, loss_mask=micro.loss_mask)  # [b, l]
        kl_term = aggregate_loss(kl, micro.loss_mask, algo.loss_agg, **agg)
        loss = pg_loss + kl_loss_coef * kl_term
        kl_share = kl_term.detach().double()
        with torch.no_grad():  # k3 per token whatever the loss's estimator, so runs stay comparable
            k3 = compute_kl(logprobs.detach(), micro.logprobs_ref, "k3", loss_mask=micro.loss_mask)
            metrics["kl/ref_k3_sum"] = k3.sum()
            metrics["kl/tokens"] = micro.loss_mask.sum()
    entropy_share = 0.0
    if algo.entropy_coef > 0:
        if entropy is None or not entropy.requires_grad:
            raise ValueError("algo.entropy_coef > 0 needs the entropy with its gradient (compute_logprobs with "
                             "with_entropy='grad')")
        entropy_term = aggregate_loss(torch.where(micro.loss_mask.bool(), entropy, 0.0), micro.loss_mask,
                                      algo.loss_agg, **agg)
        loss = loss - algo.entropy_coef * entropy_term
        entropy_share = entropy_term.detach().double()
    return loss, pg_loss.detach().double(), kl_share, entropy_share, metrics
