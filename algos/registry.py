"""The catalogue of policy losses and off-policy corrections (stdlib only): one entry per name, written once.

An entry holds everything about a loss or a correction that is not tensor math: the name of its function, which
``AlgoConfig`` fields reach which of its keywords, and the properties the config's combination rules and the
learner's ``OffPolicyPlan`` read. Everything else is derived from these two dict literals: the names the config
accepts (``algos.config``), the function tables the learner calls (``losses.POLICY_LOSSES``,
``corrections.CORRECTION_WEIGHTS``, built by resolving ``function`` in those modules), and the published default
of every hyperparameter (``keyword_defaults`` of the function's signature: the one place those numbers are written).
This module imports no torch, so that the config loads, validates and prints (``--dry-run``) without it.

Adding a loss:
1. write ``def my_loss(inputs: PolicyLossInputs, *, my_param: float = <published default>)`` in ``losses.py``
   (or a ``losses_*.py`` that ``losses.py`` imports), with its source in the docstring;
2. add ``"my_loss": LossSpec("my_loss", {"<AlgoConfig field>": "my_param"}, ...)`` to ``LOSSES``;
3. tests in ``tests/unit/test_losses.py`` and a line in docs/algorithms.md. If the loss needs a hyperparameter that
   no AlgoConfig field carries yet, the field is the one more thing to add.
Adding a correction: the same, with ``def my_weight(logprobs_prox, logprobs_behav, loss_mask, *, ...)`` in
``corrections.py`` returning ``(detached weight [B, T], metrics)``, and a ``CorrectionSpec`` in ``CORRECTIONS``.
The unit tests check that every entry's function exists and that its keyword-only parameters are exactly the
entry's keywords, so the two cannot drift.
"""
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

NO_WEIGHT = "none"
"""Correction kind: no weight; the loss ratio already compares against the right policy."""
WEIGHT = "weight"
"""Correction kind: a detached weight from ρ = π_prox / μ multiplies the loss."""
BYPASS = "bypass"
"""Correction kind: no proximal policy, the loss's trust region is centred on μ itself (old := behaviour)."""
ADVANTAGES = "advantages"
"""Correction kind: the importance weights live inside the advantages (V-trace), not in a loss weight."""
CORRECTION_KINDS = (NO_WEIGHT, WEIGHT, BYPASS, ADVANTAGES)


@dataclass(frozen=True)
class LossSpec:
    function: str
    """Name of the loss function in ``asyncrl.algos.losses``."""
    fields: dict[str, str] = field(default_factory=dict)
    """AlgoConfig field -> keyword of the function."""
    ratio_free: bool = False
    """No trust-region ratio against the centre (plain policy gradient): π_prox only feeds the ratio metrics."""
    weights_against_behaviour: bool = False
    """The loss weights by π_θ/μ itself (TOPR), so a correction weight on top would correct twice."""


@dataclass(frozen=True)
class CorrectionSpec:
    kind: str
    """One of ``CORRECTION_KINDS``."""
    function: str | None = None
    """Name of the weight function in ``asyncrl.algos.corrections``; None for kinds without one."""
    fields: dict[str, str] = field(default_factory=dict)
    """AlgoConfig field -> keyword of the function (bypass: of ``BYPASS_PG_CORRECTION``; vtrace: of
    ``compute_vtrace_advantages``)."""
    batch_global: bool = False
    """The result for a token depends on other rows: it needs π_prox of the whole batch before the first update
    (the learner then runs the no-grad proximal pass), and a weight is computed once on the whole batch."""
    only_losses: tuple[str, ...] | None = None
    """The only losses this correction pairs with (None: any)."""

    def __post_init__(self):
        if self.kind not in CORRECTION_KINDS:
            raise ValueError(f"correction kind must be one of {CORRECTION_KINDS}, got {self.kind!r}")
        if (self.function is None) == (self.kind == WEIGHT):
            raise ValueError(f"a correction of kind {self.kind!r} {'needs a' if self.kind == WEIGHT else 'takes no'} "
                             "weight function")


LOSSES: dict[str, LossSpec] = {
    "ppo": LossSpec("ppo_clip_loss", {"clip_low": "clip_low", "clip_high": "clip_high", "dual_clip_c": "dual_clip_c"}),
    "gspo": LossSpec("gspo_loss", {"clip_low": "clip_low", "clip_high": "clip_high"}),
    "gspo_token": LossSpec("gspo_token_loss", {"clip_low": "clip_low", "clip_high": "clip_high"}),
    "gmpo": LossSpec("gmpo_loss", {"clip_low": "clip_low", "clip_high": "clip_high"}),
    "cispo": LossSpec("cispo_loss", {"clip_low": "clip_low", "clip_high": "clip_high"}),
    "sapo": LossSpec("sapo_loss", {"tau_pos": "tau_pos", "tau_neg": "tau_neg"}),
    "gpg": LossSpec("gpg_loss", ratio_free=True),
    "clip_cov": LossSpec("clip_cov_loss", {"clip_low": "clip_low", "clip_high": "clip_high", "cov_ratio": "cov_ratio",
                                           "cov_low": "cov_low", "cov_high": "cov_high"}),
    "kl_cov": LossSpec("kl_cov_loss", {"cov_ratio": "cov_ratio", "kl_cov_coef": "kl_coef"}),
    "topr": LossSpec("topr_loss", ratio_free=True, weights_against_behaviour=True),
    "reinforce": LossSpec("reinforce_loss", ratio_free=True),
    "sppo": LossSpec("sppo_loss", {"sppo_eta": "eta"}),
}

CORRECTIONS: dict[str, CorrectionSpec] = {
    "none": CorrectionSpec(NO_WEIGHT),
    "decoupled": CorrectionSpec(WEIGHT, "decoupled_weight", {"is_cap": "cap", "is_mode": "mode"}),
    "bypass": CorrectionSpec(BYPASS, fields={"is_cap": "cap"}),
    "tis": CorrectionSpec(WEIGHT, "tis_weight", {"is_cap": "cap", "is_level": "level"}),
    "mis": CorrectionSpec(WEIGHT, "mis_weight", {"is_cap": "cap", "is_level": "level"}),
    "geo_rs": CorrectionSpec(WEIGHT, "geo_rs_weight", {"rs_low": "low", "rs_high": "high"}),
    "k3_rs": CorrectionSpec(WEIGHT, "k3_rs_weight", {"k3_threshold": "threshold"}),
    "icepop": CorrectionSpec(WEIGHT, "icepop_weight", {"rs_low": "low", "rs_high": "high"}),
    "m2po": CorrectionSpec(WEIGHT, "m2po_weight", {"m2_threshold": "threshold"}, batch_global=True),
    "rs": CorrectionSpec(WEIGHT, "rejection_weight", {"rs_level": "level", "rs_stat": "stat", "rs_agg": "agg",
                                                      "rs_low": "low", "rs_high": "high", "rs_weight": "weight"}),
    "seq_mis": CorrectionSpec(WEIGHT, "seq_mis_weight", {"is_cap": "cap", "rs_low": "low"}),
    "vtrace": CorrectionSpec(ADVANTAGES, fields={"vtrace_clip_rho": "clip_rho", "vtrace_clip_pg_rho": "clip_pg_rho",
                                                 "vtrace_clip_c": "clip_c"},
                             batch_global=True, only_losses=("reinforce",)),
}

CRITIC_ESTIMATORS = ("gae",)
"""Advantage estimators that read a value model's predictions (learner/critic.py): choosing one builds the critic."""
PRM_ESTIMATORS = ("prime",)
"""Advantage estimators that read an implicit process reward model's token rewards (learner/prm.py, algos/prime.py):
choosing one builds the PRM and the reference model it is measured against."""
SPPO_TARGETS = ("softmean", "bradley_terry")
"""What the sppo estimator reads a group's rewards as (algo.sppo_target): verifiable rewards (softmean, verl's
recipe) or a reward model's scores turned into Bradley–Terry win rates (bradley_terry, the paper's target)."""
GREEDY_BASELINE_ESTIMATORS = ("remax",)
"""Advantage estimators whose baseline is the reward of one greedy completion per prompt: the generators sample it
(rollout.greedy_baseline is switched on) and the learner trains only groups that carry it."""

BYPASS_PG_CORRECTION = "tis"
"""The weight that bypass gives the plain policy-gradient losses (ratio-free, not weighting against μ themselves:
reinforce, gpg): min(π_θ/μ, C) on the current pass (verl's bypass_pg_is). Its cap is ``algo.is_cap``."""
BYPASS_PG_CAP = 2.0
"""Default C of that weight (verl's bypass_pg_is preset uses 2.0)."""


def keyword_defaults(function: Callable) -> dict[str, object]:
    """{keyword-only parameter: default} of a loss or correction function: its hyperparameters and their published
    values, read from the signature so that the numbers are written only there."""
    return {p.name: p.default for p in inspect.signature(function).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}
