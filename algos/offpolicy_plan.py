"""The off-policy plan of a run (stdlib only): every choice the learner makes about π_prox and the correction,
decided once from ``AlgoConfig`` and the registry, so that the objective, the train step and the step metrics ask
the plan instead of branching on loss and correction names (docs/algorithms.md §2).

| correction                   | π_prox    | centre of the loss ratio | weight                                        |
|------------------------------|-----------|--------------------------|-----------------------------------------------|
| none                         | fused     | π_prox                   | none                                          |
| bypass                       | fused     | μ (behaviour)            | none; reinforce/gpg: min(π_θ/μ, C) on the     |
|                              |           |                          | current pass (topr already weights by μ)      |
| decoupled, tis, mis, seq_mis,| fused     | π_prox                   | from ρ = π_prox/μ, per micro-batch            |
| geo_rs, k3_rs, icepop, rs    |           |                          |                                               |
| m2po (batch-global), or any  | recompute | π_prox                   | from ρ, once on the whole batch (then         |
| with algo.is_batch_norm      |           |                          | divided by its batch mean, is_batch_norm)     |
| vtrace (batch-global)        | recompute | π_prox (unused)          | none: the weights are inside the advantages   |

The π_prox column is for one optimizer step per batch and ``algo.prox_logprobs=recompute``. The sources:
``fused``, the detached current pass, which IS the step-start policy when the batch takes one optimizer step and no
correction needs the whole batch first (it saves a forward pass); ``recompute``, the no-grad pass over the whole
batch before the first update (needed by ``algo.ppo_minibatches > 1`` and by batch-global corrections);
``loglinear``, A-3PO's interpolation between μ and the current pass (``algo.prox_logprobs=loglinear``).

The plan also decides the advantage path, once, so no learner module asks for an estimator's name:

| path                 | when                              | reads besides the rewards                        |
|----------------------|-----------------------------------|--------------------------------------------------|
| ``estimator``        | every other ``algo.advantage``    | remax: each group's greedy ``baseline_reward``   |
| ``gae``              | ``algo.advantage=gae``            | the critic's values                              |
| ``vtrace``           | ``algo.correction=vtrace``        | π_prox, μ, and ``algo.vtrace_values``'s baseline |
| ``prime``            | ``algo.advantage=prime``          | the implicit PRM's token rewards (learner/prm.py)|
"""
from dataclasses import dataclass, field

from asyncrl.algos.registry import (
    ADVANTAGES,
    BYPASS,
    BYPASS_PG_CAP,
    BYPASS_PG_CORRECTION,
    CORRECTIONS,
    CRITIC_ESTIMATORS,
    LOSSES,
    PRM_ESTIMATORS,
    WEIGHT,
)

PROX_FUSED, PROX_RECOMPUTE, PROX_LOGLINEAR = "fused", "recompute", "loglinear"
CENTRE_PROX, CENTRE_BEHAV = "prox", "behav"
WEIGHT_NONE = "none"
"""No weight multiplies the loss."""
WEIGHT_PER_MICRO = "per_micro"
"""The correction's weight from ρ = π_prox/μ, computed for each micro-batch (row-wise corrections)."""
WEIGHT_BATCH = "batch"
"""The correction's weight computed once on the whole batch before the first update (batch-global, m2po)."""
ADVANTAGE_ESTIMATOR, ADVANTAGE_GAE, ADVANTAGE_VTRACE, ADVANTAGE_PRIME = "estimator", "gae", "vtrace", "prime"
"""The advantage paths (module doc): a group-level estimator of ``advantages.ADVANTAGE_ESTIMATORS``, GAE over the
critic's values, V-trace's advantages from π_prox and μ, or PRIME's from the implicit PRM's token rewards and the
outcome rewards (algos/prime.py)."""
WEIGHT_CURRENT = "current"
"""``BYPASS_PG_CORRECTION``'s weight from π_θ/μ on the current pass, per micro-batch (bypass with plain PG)."""


@dataclass(frozen=True)
class OffPolicyPlan:
    loss: str
    """The loss's name in ``losses.POLICY_LOSSES``."""
    loss_kwargs: dict
    """Its hyperparameters as set in the config (unset ones keep the function's published defaults)."""
    prox_source: str
    """Where π_prox comes from: PROX_FUSED, PROX_RECOMPUTE or PROX_LOGLINEAR (module doc)."""
    centre: str
    """Trust-region centre of the loss ratio: CENTRE_PROX (π_prox) or CENTRE_BEHAV (μ, bypass mode)."""
    weight_source: str = WEIGHT_NONE
    """Which detached weight multiplies the loss, and where it is computed: one of the WEIGHT_* constants."""
    weight_correction: str | None = None
    """Name of the correction whose weight function gives that weight (``corrections.CORRECTION_WEIGHTS``)."""
    weight_kwargs: dict = field(default_factory=dict)
    """Keywords of the weight function: the config's (plus BYPASS_PG_CAP as bypass's default cap)."""
    weight_batch_norm: str | None = None
    """``algo.is_batch_norm``: the level (token or sequence) at which the batch's weights are normalised to mean 1
    (``corrections.normalize_batch_weight``); the weight is then computed once on the whole batch."""
    vtrace_advantages: bool = False
    """The advantages are V-trace's, computed from π_prox and μ on the whole batch, instead of the estimator's."""
    vtrace_kwargs: dict = field(default_factory=dict)
    """Keywords of ``compute_vtrace_advantages`` set in the config."""
    advantage_path: str = ADVANTAGE_ESTIMATOR
    """How the advantages are computed: ADVANTAGE_ESTIMATOR, ADVANTAGE_GAE, ADVANTAGE_VTRACE or ADVANTAGE_PRIME."""
    estimator: str = "grpo"
    """``algo.advantage``: the estimator's name on the ADVANTAGE_ESTIMATOR path."""
    vtrace_baseline: str = "none"
    """On the ADVANTAGE_VTRACE path, V-trace's baseline (``algo.vtrace_values``): none, group_mean or critic."""
    critic_values: bool = False
    """The advantages read a critic's values (GAE, or V-trace with the critic baseline): the learner builds and
    trains one, and its values are computed before the advantages."""
    greedy_baseline: bool = False
    """The estimator's baseline is the reward of one greedy completion per prompt (ReMax): a group without a
    finite ``meta["baseline_reward"]`` cannot be trained, and the step reports the baselines' mean."""

    @classmethod
    def from_algo(cls, algo) -> "OffPolicyPlan":
        """The plan of an ``AlgoConfig`` (already validated, so the pair is one the config accepts)."""
        loss, correction = LOSSES[algo.loss], CORRECTIONS[algo.correction]
        vtrace = correction.kind == ADVANTAGES
        return cls(loss=algo.loss, loss_kwargs=algo.loss_kwargs(), prox_source=_prox_source(algo, correction),
                   centre=CENTRE_BEHAV if correction.kind == BYPASS else CENTRE_PROX,
                   vtrace_advantages=vtrace, vtrace_kwargs=algo.correction_kwargs() if vtrace else {},
                   **_advantage_path(algo, vtrace), **_weight(algo, loss, correction))

    @property
    def batch_metrics_correction(self) -> str | None:
        """The correction whose statistics the step metrics report on the whole batch (from π_prox), or None.
        Bypass's weight on the current pass is left out: it measures θ against μ, not the data's staleness."""
        return self.weight_correction if self.weight_source in (WEIGHT_PER_MICRO, WEIGHT_BATCH) else None


def _prox_source(algo, correction) -> str:
    if algo.prox_logprobs == PROX_LOGLINEAR:
        return PROX_LOGLINEAR
    if algo.ppo_minibatches > 1 or correction.batch_global or algo.is_batch_norm:
        return PROX_RECOMPUTE  # after the first optimizer step the current pass is no longer π_prox
    return PROX_FUSED


def _advantage_path(algo, vtrace: bool) -> dict:
    """The advantage_* fields of the plan: V-trace replaces the estimator (the config keeps algo.advantage at its
    default then); GAE is the estimator that reads the critic (``algo.needs_critic``)."""
    if vtrace:
        path = ADVANTAGE_VTRACE
    else:
        path = (ADVANTAGE_GAE if algo.advantage in CRITIC_ESTIMATORS else
                ADVANTAGE_PRIME if algo.advantage in PRM_ESTIMATORS else ADVANTAGE_ESTIMATOR)
    return dict(advantage_path=path, estimator=algo.advantage,
                vtrace_baseline=algo.vtrace_values if vtrace else "none", critic_values=algo.needs_critic(),
                greedy_baseline=algo.needs_greedy_baseline())


def _weight(algo, loss, correction) -> dict:
    """The weight_* fields of the plan."""
    if correction.kind == WEIGHT:
        source = WEIGHT_BATCH if correction.batch_global or algo.is_batch_norm else WEIGHT_PER_MICRO
        return dict(weight_source=source, weight_correction=algo.correction, weight_kwargs=algo.correction_kwargs(),
                    weight_batch_norm=algo.weight_level() if algo.is_batch_norm else None)
    if correction.kind == BYPASS and loss.ratio_free and not loss.weights_against_behaviour:
        kwargs = {"cap": BYPASS_PG_CAP, **algo.correction_kwargs()}  # bypass's only field is is_cap -> cap
        return dict(weight_source=WEIGHT_CURRENT, weight_correction=BYPASS_PG_CORRECTION, weight_kwargs=kwargs)
    return {}  # none, vtrace, and bypass with a loss whose own ratio (or weight) is already against μ
