"""The loss of one micro-batch, assembled from `asyncrl.algos` and nothing else (DESIGN.md §5).

Which policy is the trust-region centre, and which weight multiplies the loss, depends on the correction:

| correction                  | centre of the loss ratio | is_weight                                     |
|-----------------------------|--------------------------|-----------------------------------------------|
| none                        | π_prox                   | none                                          |
| bypass                      | μ (behaviour)            | none; reinforce/gpg: min(π_θ/μ, C), detached  |
|                             |                          | (topr already weights by min(1, π_θ/μ))      |
| decoupled, tis, mis, geo_rs,| π_prox                   | from ρ = π_prox/μ, per micro-batch            |
| k3_rs, icepop               |                          |                                               |
| m2po                        | π_prox                   | computed once on the whole batch              |
| vtrace                      | π_prox (unused: reinforce)| none: the weights are inside the advantages  |

π_prox is, by `choose_prox_source`: the detached current logprobs (`fused`: exact when the batch takes one optimizer step
and no correction needs the whole batch first), the no-grad pass stored in the batch (`recompute`), or A-3PO's
log-linear interpolation between μ and the current policy (`loglinear`).
"""
from dataclasses import dataclass

import torch

from asyncrl.algos.corrections import CORRECTION_HYPERPARAMETERS, approximate_prox_logprobs, compute_correction
from asyncrl.algos.kl import compute_kl
from asyncrl.algos.losses import LOSS_HYPERPARAMETERS, POLICY_LOSSES, aggregate_loss

BYPASS_PG_CAP = 2.0
"""Default C of min(π_θ/μ, C) for reinforce/gpg in bypass mode (verl's bypass_pg_is preset uses 2.0)."""


@dataclass
class StepCounts:
    """Global normalisers of one optimizer step (all its micro-batches)."""

    tokens: float
    seqs: float


def resolved_hyperparameters(algo) -> dict:
    """The loss's and correction's hyperparameters as they will be used (published defaults filled in), for the
    run's MLflow params: a null in the recipe should not hide which ε a run trained with."""
    loss = {**LOSS_HYPERPARAMETERS[algo.loss], **algo.loss_kwargs()}
    correction = {**CORRECTION_HYPERPARAMETERS.get(algo.correction, {}), **algo.correction_kwargs()}
    if algo.correction == "bypass" and algo.loss in ("reinforce", "gpg"):
        correction.setdefault("cap", BYPASS_PG_CAP)
    resolved = {f"algo.resolved.{algo.loss}.{k}": str(v) for k, v in loss.items()}
    resolved.update({f"algo.resolved.{algo.correction}.{k}": str(v) for k, v in correction.items()})
    return resolved


def choose_prox_source(algo) -> str:
    """`fused`, `recompute` or `loglinear`: where π_prox comes from for this config (see the module doc)."""
    if algo.prox_logprobs == "loglinear":
        return "loglinear"
    if algo.ppo_minibatches > 1 or algo.correction in ("m2po", "vtrace"):
        return "recompute"
    return "fused"


def resolve_prox(source: str, logprobs: torch.Tensor, micro, version: int) -> torch.Tensor:
    """π_prox logprobs [b, l] for this micro-batch, detached."""
    if source == "fused":
        return logprobs.detach()
    if source == "recompute":
        return micro.logprobs_prox
    return approximate_prox_logprobs(logprobs.detach(), micro.logprobs_behav, micro.versions, micro.loss_mask,
                                     learner_version=version)


def micro_is_weight(algo, logprobs: torch.Tensor, prox: torch.Tensor, micro):
    """The detached per-token weight for this micro-batch, or None (see the module table)."""
    if micro.is_weight is not None:
        return micro.is_weight
    if algo.correction in ("none", "vtrace"):
        return None
    if algo.correction == "bypass":
        if algo.loss not in ("reinforce", "gpg"):
            return None  # the loss's own ratio (or TOPR's own weight) is already against μ: no second weight
        cap = algo.is_cap if algo.is_cap is not None else BYPASS_PG_CAP
        weight, _ = compute_correction("tis", logprobs.detach(), micro.logprobs_behav, micro.loss_mask, cap=cap)
        return weight
    weight, _ = compute_correction(algo.correction, prox, micro.logprobs_behav, micro.loss_mask,
                                   **algo.correction_kwargs())
    return weight


def compute_micro_loss(algo, logprobs: torch.Tensor, prox: torch.Tensor, micro, counts: StepCounts,
                       kl_loss_coef: float, generator: torch.Generator | None = None):
    """This micro-batch's share of the step loss (a scalar with grad), its policy-loss and KL-loss shares
    (detached floats; summing them over micro-batches gives the step's values) and its token metrics."""
    centre = micro.logprobs_behav if algo.correction == "bypass" else prox
    weight = micro_is_weight(algo, logprobs, prox, micro)
    extra = {"generator": generator} if algo.loss == "clip_cov" else {}
    per_token, metrics = POLICY_LOSSES[algo.loss](
        logprobs, centre, micro.advantages, micro.loss_mask, is_weight=weight,
        logprobs_behav=micro.logprobs_behav, **algo.loss_kwargs(), **extra)
    agg = dict(global_tokens=counts.tokens, global_seqs=counts.seqs, norm_constant=algo.loss_norm_constant)
    pg_loss = aggregate_loss(per_token, micro.loss_mask, algo.loss_agg, **agg)
    loss, kl_share, metrics = pg_loss, 0.0, dict(metrics)
    if kl_loss_coef > 0:
        kl = compute_kl(logprobs, micro.logprobs_ref, algo.kl_loss_type, loss_mask=micro.loss_mask)  # [b, l]
        kl_term = aggregate_loss(kl, micro.loss_mask, algo.loss_agg, **agg)
        loss = pg_loss + kl_loss_coef * kl_term
        kl_share = float(kl_term.detach())
        with torch.no_grad():  # k3 per token whatever the loss's estimator, so runs stay comparable
            k3 = compute_kl(logprobs.detach(), micro.logprobs_ref, "k3", loss_mask=micro.loss_mask)
            metrics["kl/ref_k3_sum"] = k3.sum()
            metrics["kl/tokens"] = micro.loss_mask.sum()
    return loss, float(pg_loss.detach()), kl_share, metrics
