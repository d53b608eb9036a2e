"""Algorithm choices (stdlib only): advantage estimator, policy loss, off-policy correction, KL terms, aggregation.

The loss and correction names, which config field reaches which keyword, and the properties the combination rules
read all come from ``asyncrl.algos.registry`` (stdlib too, so the config loads, validates and prints without torch).
Loss and correction hyperparameters default to None, which means "the published default of the chosen
loss/correction": the single source of those numbers is the keyword defaults of the functions in ``asyncrl.algos``,
so that a GSPO run does not silently inherit PPO's ε = 0.2 (GSPO's is 3e-4). Setting a hyperparameter that the
chosen loss or correction does not read is an error, not a silent no-op.

Combination rules (``check_combination``) are checked when the config loads; each rejected pair says why.
"""
from dataclasses import dataclass, fields
from typing import Optional

from asyncrl.algos.registry import (ADVANTAGES, BYPASS, CORRECTIONS, CRITIC_ESTIMATORS, GREEDY_BASELINE_ESTIMATORS,
                                    LOSSES, NO_WEIGHT, PRM_ESTIMATORS, SPPO_TARGETS)

CRITIC_ADVANTAGES = CRITIC_ESTIMATORS
"""Estimators that read a value model's predictions (the registry's list)."""
ADVANTAGE_NAMES = ("grpo", "grpo_passk", "rloo", "reinforce_pp", "reinforce_pp_baseline", "opo", "gpg", "remax",
                   "sppo", *CRITIC_ADVANTAGES, *PRM_ESTIMATORS)
DISCOUNTED = ("reinforce_pp", "gae")
"""Estimators that read algo.gamma."""
GROUP_ADVANTAGES = ("grpo_passk", "rloo", "reinforce_pp_baseline", "opo", "gpg", "sppo", "prime")
"""Estimators whose baseline is the rest of the group: they need rollout.n >= 2."""
PER_TURN_ADVANTAGES = ("grpo", "grpo_passk", "rloo")
"""Estimators that can train per-turn samples (rollout.turn_samples=per_turn): one advantage per episode, from the
group's episode rewards, given to each of its turns (algos/turn_advantages.py)."""
LOSS_NAMES = tuple(LOSSES)
CORRECTION_NAMES = tuple(CORRECTIONS)
LOSS_AGG_NAMES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_NAMES = ("k1", "k2", "k3", "k3+", "abs")
PROX_METHODS = ("recompute", "loglinear")
BATCH_NORMALISABLE = ("decoupled", "tis", "mis", "seq_mis", "icepop", "m2po", "rs")
"""Corrections whose kept tokens carry an importance ratio, which algo.is_batch_norm can normalise."""


def check_combination(loss: str, correction: str, advantage: str, prox_logprobs: str) -> None:
    """Raise ValueError for a loss/correction pair that is invalid or corrects twice, with the reason."""
    loss_spec, spec = LOSSES[loss], CORRECTIONS[correction]
    if loss_spec.weights_against_behaviour and spec.kind not in (NO_WEIGHT, BYPASS):
        raise ValueError(
            f"algo.loss={loss} with algo.correction={correction} corrects twice: {loss} already weights its samples "
            "against the behaviour policy (TOPR: negative samples by min(1, π_θ/μ)); use algo.correction=none")
    if spec.only_losses is not None and loss not in spec.only_losses:
        raise ValueError(
            f"algo.correction={correction} needs algo.loss={'/'.join(spec.only_losses)}: it puts its truncated "
            f"importance weights into the advantages (V-trace), and {loss}'s own ratio would weight the same tokens "
            "a second time")
    if spec.kind == ADVANTAGES and advantage != "grpo":
        raise ValueError(
            f"algo.correction={correction} computes its own advantages from the rewards (algo.vtrace_values picks the "
            f"baseline), so algo.advantage={advantage} would be ignored; leave algo.advantage at its default")
    if prox_logprobs == "loglinear" and spec.kind == BYPASS:
        raise ValueError(f"algo.prox_logprobs=loglinear approximates π_prox, but algo.correction={correction} has no "
                         "proximal policy (old := behaviour); drop one of them")
    if prox_logprobs == "loglinear" and spec.batch_global:
        raise ValueError(f"algo.correction={correction} needs the exact π_prox of the whole batch before the first "
                         "update; algo.prox_logprobs=loglinear exists to skip that pass; use recompute")
    if prox_logprobs == "loglinear" and loss_spec.ratio_free and spec.kind == NO_WEIGHT:
        raise ValueError(f"algo.loss={loss} with algo.correction={correction} never reads π_prox, so "
                         "algo.prox_logprobs=loglinear has nothing to approximate")


@dataclass
class AlgoConfig:
    advantage: str = "grpo"
    """Advantage estimator: grpo, grpo_passk (only each group's best completion learns), rloo, reinforce_pp,
    reinforce_pp_baseline, opo, gpg, remax (needs one greedy sample per prompt, which the generators then
    supply), sppo (with algo.loss=sppo), gae (PPO with a critic: the `critic` section's value model, trained beside
    the policy), prime (PRIME: token rewards from the `prm` section's implicit process reward model, trained online
    beside the policy on the outcome rewards)."""
    norm_adv_by_std: bool = True
    """GRPO (and grpo_passk): divide by the group's std (False gives Dr.GRPO)."""
    gamma: float = 1.0
    """Discount of token rewards for reinforce_pp and gae (per token)."""
    lam: float = 1.0
    """GAE's λ (gae only): 1 gives Â_t = R - V_t with γ = 1 (verl's default), lower trades variance for the
    critic's bias."""
    loss: str = "ppo"
    """Policy loss: ppo, gspo, gspo_token, gmpo, cispo, sapo, gpg, clip_cov, kl_cov, topr, reinforce."""
    clip_low: Optional[float] = None
    """ε_low: the ratio is clipped at 1 - clip_low (ppo 0.2, gspo 3e-4; gmpo: the log-ratio at -0.4; cispo: None =
    no lower bound)."""
    clip_high: Optional[float] = None
    """ε_high (clip-higher): the ratio is clipped at 1 + clip_high (ppo 0.28, gspo 4e-4)."""
    dual_clip_c: Optional[float] = None
    """ppo dual-clip bound c > 1 for negative advantages (verl uses 3.0); None disables it."""
    tau_pos: Optional[float] = None
    """sapo gate temperature for A > 0 (1.0)."""
    tau_neg: Optional[float] = None
    """sapo gate temperature for A <= 0 (1.05)."""
    cov_ratio: Optional[float] = None
    """clip_cov / kl_cov: fraction of tokens selected by covariance (2e-4 / 2e-3)."""
    cov_low: Optional[float] = None
    """clip_cov: lower covariance bound for selection (1.0)."""
    cov_high: Optional[float] = None
    """clip_cov: upper covariance bound for selection (5.0)."""
    kl_cov_coef: Optional[float] = None
    """kl_cov: coefficient of |ℓθ - ℓprox| on the selected tokens (1.0)."""
    sppo_eta: Optional[float] = None
    """sppo: η of the multiplicative-weights step, the scale of the target η (R - SM_η(R)) and the soft-mean's
    temperature (1.0, verl's sppo_eta)."""
    sppo_target: str = "softmean"
    """sppo: what the target reads the group's rewards as. softmean: verifiable rewards, s = R - SM_η(R) (verl's
    recipe). bradley_terry: a reward model's scores (reward.functions[].server, `asyncrl reward-server`), s = P̂ - ½
    with P̂ each sample's win rate against its group, P(y_i ≻ y_j) = σ(r_i - r_j) (the paper's target)."""
    correction: str = "decoupled"
    """Off-policy correction: none, decoupled (AReaL), bypass (old := behaviour), tis, mis, seq_mis, geo_rs, k3_rs,
    icepop, rs (the rejection-sampling family), m2po, vtrace."""
    is_cap: Optional[float] = None
    """Upper bound C on the importance weight (decoupled 5.0, tis/mis/seq_mis 2.0, bypass with reinforce/gpg
    2.0)."""
    is_mode: Optional[str] = None
    """decoupled: `truncate` (w = min(w, C)) or `mask` (w = 0 above C); default truncate."""
    is_level: Optional[str] = None
    """tis/mis: `token` or `sequence` (default token)."""
    rs_low: Optional[float] = None
    """geo_rs / icepop lower bound on the ratio (0.999 / 0.5); seq_mis on ρ(y) (1 / is_cap); rs: on its statistic
    (none)."""
    rs_high: Optional[float] = None
    """geo_rs / icepop upper bound on the ratio (1.001 / 5.0); rs: on its statistic (0.01)."""
    rs_level: Optional[str] = None
    """rs: judge each `token` or each `sequence` (default sequence)."""
    rs_stat: Optional[str] = None
    """rs: the statistic of log ρ_t: k1 (log ρ), k2 ((log ρ)²/2) or k3 (ρ - 1 - log ρ; default)."""
    rs_agg: Optional[str] = None
    """rs at sequence level: `mean` (default), `sum` or `max` of the statistic over the sequence."""
    rs_weight: Optional[str] = None
    """rs: a kept token weighs `one` (default) or its `ratio` (ρ_t, or ρ(y) at sequence level)."""
    k3_threshold: Optional[float] = None
    """k3_rs: reject a sequence whose mean per-token k3 exceeds this (0.01)."""
    m2_threshold: Optional[float] = None
    """m2po: mask the largest squared log-ratios until their mean over kept tokens is below this (0.04)."""
    vtrace_clip_rho: Optional[float] = None
    """vtrace ρ̄ (1.0)."""
    vtrace_clip_pg_rho: Optional[float] = None
    """vtrace ρ̄_pg (1.0)."""
    vtrace_clip_c: Optional[float] = None
    """vtrace c̄ (1.0)."""
    vtrace_values: str = "group_mean"
    """vtrace baseline: `none` (critic-free, V = 0), `group_mean` (V = the prompt's mean reward in the group) or
    `critic` (the `critic` section's value model, which regresses the V-trace targets v_s)."""
    prox_logprobs: str = "recompute"
    """How π_prox is obtained: `recompute` (exact: a no-grad pass, skipped when it equals the first forward) or
    `loglinear` (A-3PO approximation from the behaviour logprobs and versions; saves the pass)."""
    is_batch_norm: bool = False
    """Self-normalised IS (verl's rollout_is_batch_normalize): divide the correction's weights by their mean over
    the batch (tokens, or sequences for a sequence-level weight), computed once on the whole batch. Only for
    corrections whose kept tokens carry an importance ratio."""
    ppo_minibatches: int = 1
    """Optimizer steps per batch (the batch's rows are split into this many mini-batches)."""
    entropy_coef: float = 0.0
    """Entropy bonus: entropy_coef times the policy's entropy (at the sampling temperature, over each row's
    nucleus), aggregated like the loss, is subtracted from it (verl's entropy_coeff; 0 = off). Logged as
    loss/entropy."""
    kl_loss_coef: float = 0.0
    """Coefficient of a KL(π_θ‖π_ref) loss term; > 0 loads the reference model."""
    kl_loss_type: str = "k3"
    """KL estimator of the loss term: k2, k3 (low_var_kl), k3+ (k3 value, k2 gradient) or abs (|δ|). k1 has zero
    expected gradient as a loss and is rejected."""
    kl_reward_coef: float = 0.0
    """Initial coefficient β of a per-token KL penalty on the reward; > 0 loads the reference model."""
    kl_reward_type: str = "k1"
    """KL estimator of the reward penalty: k1, k2, k3, k3+, abs."""
    kl_controller: str = "fixed"
    """Reward-penalty controller: `fixed` or `adaptive` (Ziegler et al. 2019: β tracks kl_target)."""
    kl_target: float = 0.1
    """adaptive controller: target KL, per token averaged over sequences (nats; verl's convention)."""
    kl_horizon: float = 10000.0
    """adaptive controller: horizon in samples."""
    loss_agg: str = "token-mean"
    """Loss aggregation; normalisers are global over the optimizer step."""
    loss_norm_constant: Optional[float] = None
    """Constant divisor for seq-mean-token-sum-norm (Dr.GRPO), e.g. the max completion length."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and keep pulling until the batch is full (counted)."""
    unlearnable_after_groups: int = 1024
    """Groups sampled (trained, dropped, or filtered by the generators) after which, if none of them had rewards
    that differ within the group, the learner says there is nothing to learn, with the rewards it saw and what to
    check: with dynamic_sampling it stops the job (no batch can ever fill), without it warns once. 0 = never
    decide (wait up to learner.wait_for_batch_timeout_s). One group with differing rewards disarms it for the
    rest of the job (learner/learnable.py). 1024: a policy that solves 1 sample in 200 (the tests' weakest warm
    start) at rollout.n = 2 passes it with probability 1 - 3e-5; a broken job samples 1024 groups in about 20 s
    on the CPU demo."""

    def __post_init__(self):
        for key, allowed in (("advantage", ADVANTAGE_NAMES), ("loss", LOSS_NAMES), ("correction", CORRECTION_NAMES),
                             ("loss_agg", LOSS_AGG_NAMES), ("kl_loss_type", KL_NAMES),
                             ("kl_reward_type", KL_NAMES), ("kl_controller", ("fixed", "adaptive")),
                             ("prox_logprobs", PROX_METHODS), ("vtrace_values", ("none", "group_mean", "critic"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"algo.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.unlearnable_after_groups < 0:
            raise ValueError(f"algo.unlearnable_after_groups must be >= 0 (0: never stop), got "
                             f"{self.unlearnable_after_groups}")
        check_combination(self.loss, self.correction, self.advantage, self.prox_logprobs)
        self._check_sppo()
        self._check_hyperparameters_are_read()
        self._check_ranges()
        if self.kl_loss_coef > 0 and self.kl_loss_type == "k1":
            raise ValueError("algo.kl_loss_type=k1 has zero expected gradient as a loss term (E∇k1 = 0); "
                             "use k2, k3 or k3+, or put k1 on the reward with algo.kl_reward_coef")
        if self.advantage in PRM_ESTIMATORS and self.kl_reward_coef > 0:
            raise ValueError("algo.advantage=prime places each completion's outcome on its last token, so a per-token "
                             "KL penalty in the reward (algo.kl_reward_coef) would be summed into it; put the KL in "
                             "the loss (algo.kl_loss_coef) instead")
        if self.kl_loss_coef > 0 and self.kl_reward_coef > 0:
            raise ValueError("algo.kl_loss_coef and algo.kl_reward_coef are both > 0: the KL to the reference "
                             "would be penalised twice; keep one")
        if self.is_batch_norm:
            if self.correction not in BATCH_NORMALISABLE or (self.correction == "rs" and self.rs_weight != "ratio"):
                raise ValueError(
                    f"algo.is_batch_norm normalises importance weights, and algo.correction={self.correction}"
                    f"{' with rs_weight=' + str(self.rs_weight or 'one') if self.correction == 'rs' else ''} gives "
                    f"none to normalise (use one of {BATCH_NORMALISABLE}; rs needs rs_weight=ratio)")
            if self.prox_logprobs == "loglinear":
                raise ValueError("algo.is_batch_norm needs the exact π_prox of the whole batch before the first "
                                 "update; algo.prox_logprobs=loglinear exists to skip that pass; use recompute")
        if self.loss_agg == "seq-mean-token-sum-norm" and not self.loss_norm_constant:
            raise ValueError("algo.loss_norm_constant must be set (> 0) when algo.loss_agg=seq-mean-token-sum-norm")

    def _check_sppo(self) -> None:
        """SPPO is one algorithm spread over three keys: its loss regresses onto its own advantage (the target's η is
        the loss's), against the policy that sampled (bypass), averaged per sequence."""
        if (self.loss == "sppo") != (self.advantage == "sppo"):
            raise ValueError(f"algo.loss=sppo and algo.advantage=sppo go together (the loss regresses the sequence "
                             f"log-ratio onto η (R - SM_η(R)), the advantage's target); got loss={self.loss}, "
                             f"advantage={self.advantage} (configs/sppo.yaml sets them)")
        if self.sppo_target not in SPPO_TARGETS:
            raise ValueError(f"algo.sppo_target must be one of {', '.join(SPPO_TARGETS)}, got {self.sppo_target!r}")
        if self.sppo_target != "softmean" and self.advantage != "sppo":
            raise ValueError(f"algo.sppo_target={self.sppo_target} is the sppo advantage's; algo.advantage="
                             f"{self.advantage} does not read it")
        if self.loss == "sppo" and self.correction != "bypass":
            raise ValueError(f"algo.loss=sppo regresses log π_θ/π_t against the policy that sampled: it needs "
                             f"algo.correction=bypass (the centre is μ), got {self.correction}")
        if self.loss == "sppo" and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(f"algo.loss=sppo's loss is one value per sequence, averaged over sequences: it needs "
                             f"algo.loss_agg=seq-mean-token-mean, got {self.loss_agg}")

    def _check_hyperparameters_are_read(self) -> None:
        used = set(LOSSES[self.loss].fields) | set(CORRECTIONS[self.correction].fields)
        optional = {f.name for f in fields(self) if f.default is None and f.name != "loss_norm_constant"}
        for name in sorted(optional - used):
            if getattr(self, name) is not None:
                raise ValueError(f"algo.{name} is set, but algo.loss={self.loss} with algo.correction="
                                 f"{self.correction} does not use it")

    def _check_ranges(self) -> None:
        if self.sppo_eta is not None and not self.sppo_eta > 0:
            raise ValueError(f"algo.sppo_eta must be > 0, got {self.sppo_eta}")
        if self.clip_low is not None and not 0 <= self.clip_low <= 1:
            raise ValueError(f"algo.clip_low must be in [0, 1], got {self.clip_low}")
        if self.clip_high is not None and self.clip_high < 0:
            raise ValueError(f"algo.clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"algo.dual_clip_c must be > 1 or null, got {self.dual_clip_c}")
        if self.is_cap is not None and self.is_cap <= 1:
            raise ValueError(f"algo.is_cap must be > 1, got {self.is_cap}")
        if self.is_mode not in (None, "truncate", "mask"):
            raise ValueError(f"algo.is_mode must be truncate or mask, got {self.is_mode!r}")
        if self.is_level not in (None, "token", "sequence"):
            raise ValueError(f"algo.is_level must be token or sequence, got {self.is_level!r}")
        if self.correction == "rs":  # bounds on a statistic: k1 is a log-ratio, negative below 1
            if None not in (self.rs_low, self.rs_high) and not self.rs_low < self.rs_high:
                raise ValueError(f"algo.rs_low/rs_high must satisfy low < high, got {self.rs_low}/{self.rs_high}")
            for name, allowed in (("rs_level", ("token", "sequence")), ("rs_stat", ("k1", "k2", "k3")),
                                  ("rs_agg", ("mean", "sum", "max")), ("rs_weight", ("one", "ratio"))):
                if getattr(self, name) not in (None, *allowed):
                    raise ValueError(f"algo.{name} must be one of {allowed}, got {getattr(self, name)!r}")
            if self.rs_agg is not None and self.rs_level == "token":
                raise ValueError("algo.rs_agg aggregates the statistic over a sequence, and algo.rs_level=token "
                                 "judges each token alone; drop one of them")
        elif None not in (self.rs_low, self.rs_high) and not 0 <= self.rs_low < self.rs_high:
            raise ValueError(f"algo.rs_low/rs_high must satisfy 0 <= low < high, got {self.rs_low}/{self.rs_high}")
        for name in ("tau_pos", "tau_neg", "cov_ratio", "k3_threshold", "m2_threshold", "vtrace_clip_rho",
                     "vtrace_clip_pg_rho", "vtrace_clip_c", "kl_cov_coef"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"algo.{name} must be > 0, got {getattr(self, name)}")
        if self.ppo_minibatches < 1:
            raise ValueError(f"algo.ppo_minibatches must be >= 1, got {self.ppo_minibatches}")
        if self.entropy_coef < 0:
            raise ValueError(f"algo.entropy_coef must be >= 0 (a bonus), got {self.entropy_coef}")
        if self.kl_loss_coef < 0 or self.kl_reward_coef < 0:
            raise ValueError("algo.kl_loss_coef and algo.kl_reward_coef must be >= 0")
        if self.kl_target <= 0 or self.kl_horizon <= 0:
            raise ValueError("algo.kl_target and algo.kl_horizon must be > 0")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"algo.gamma must be in (0, 1], got {self.gamma}")
        if self.gamma != 1.0 and self.advantage not in DISCOUNTED:
            raise ValueError(f"algo.gamma discounts token rewards for {'/'.join(DISCOUNTED)} only; algo.advantage="
                             f"{self.advantage} uses the undiscounted outcome reward (got gamma={self.gamma})")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"algo.lam must be in [0, 1], got {self.lam}")
        if self.lam != 1.0 and self.advantage != "gae":
            raise ValueError(f"algo.lam is GAE's λ and algo.advantage={self.advantage} is not gae (got lam={self.lam})")

    def weight_level(self) -> str:
        """Whether the correction's weight is per token or per sequence (what is_batch_norm averages over)."""
        if self.correction == "seq_mis":
            return "sequence"
        if self.correction in ("tis", "mis"):
            return self.is_level or "token"
        if self.correction == "rs":
            return self.rs_level or "sequence"
        return "token"

    def needs_critic(self) -> bool:
        """A value model is built and trained only for estimators that read it (gae, V-trace's critic baseline)."""
        return self.advantage in CRITIC_ADVANTAGES or (self.correction == "vtrace" and self.vtrace_values == "critic")

    def per_turn_problem(self) -> str | None:
        """Why these settings cannot train per-turn samples (rollout.turn_samples=per_turn), or None when they can."""
        if CORRECTIONS[self.correction].kind == ADVANTAGES:
            return (f"algo.correction={self.correction} computes token-level advantages along one sequence, and "
                    f"per-turn samples split an episode into several")
        if self.advantage not in PER_TURN_ADVANTAGES:
            return (f"algo.advantage={self.advantage} is not one of {PER_TURN_ADVANTAGES}, the estimators that give "
                    f"each turn its episode's advantage")
        return None

    def needs_greedy_baseline(self) -> bool:
        """ReMax's baseline: one greedy completion per prompt, sampled by the generators and read by the learner."""
        return self.advantage in GREEDY_BASELINE_ESTIMATORS

    def needs_prm(self) -> bool:
        """PRIME's implicit process reward model is built and trained only for the estimators that read it."""
        return self.advantage in PRM_ESTIMATORS

    def needs_reference_model(self) -> bool:
        """The reference model is loaded only when some KL coefficient is non-zero, or for PRIME, whose token
        rewards are the PRM's log-ratio to it."""
        return self.kl_loss_coef > 0 or self.kl_reward_coef > 0 or self.needs_prm()

    def loss_kwargs(self) -> dict:
        """Keyword arguments of the chosen loss: only the hyperparameters set, so the others keep their
        published defaults."""
        return {kw: getattr(self, f) for f, kw in LOSSES[self.loss].fields.items() if getattr(self, f) is not None}

    def correction_kwargs(self) -> dict:
        """Keyword arguments of the chosen correction (set hyperparameters only)."""
        return {kw: getattr(self, f) for f, kw in CORRECTIONS[self.correction].fields.items()
                if getattr(self, f) is not None}
