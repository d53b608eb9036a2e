"""A K-armed bandit trained from stale behaviour data, through the same learner objective the real learner uses.

Each "sequence" is one token (one arm pull); one prompt, so a group is n pulls of the same bandit. The behaviour
policy μ is the policy of `STALENESS` optimizer steps ago, exactly what an async generator fleet produces.
1. Every loss-and-correction pair we claim is valid for stale data converges to the best arm.
2. The corrected gradient estimate from μ's samples matches the exact on-policy gradient within Monte-Carlo
   error, and the uncorrected one does not (so the test can fail).
"""
import math

import pytest
import torch

from asyncrl.algos.advantages import AdvantageInputs, compute_token_advantages
from asyncrl.algos.config import AlgoConfig
from asyncrl.algos.corrections import compute_correction, compute_vtrace_advantages
from asyncrl.algos.losses import POLICY_LOSSES
from asyncrl.algos.offpolicy_plan import WEIGHT_BATCH, OffPolicyPlan
from asyncrl.learner.objective import StepCounts, compute_micro_loss

F64 = torch.float64
ARM_MEANS = torch.tensor([0.2, 0.5, 0.9, 0.3, 0.6], dtype=F64)
BEST = int(ARM_MEANS.argmax())
STALENESS = 3
STALE_CORRECTIONS = ("decoupled", "tis", "mis", "icepop", "m2po", "bypass")
RATIO_LOSSES = ("ppo", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "clip_cov", "kl_cov", "gpg", "reinforce")
# GSPO's trust region (±4e-4 on the sequence ratio) centred on a 3-step-old μ (bypass) clips nearly every sample,
# so gspo/gspo_token + bypass stall on stale data (π(best) ≈ 0.54 after 300 steps): not claimed, use decoupled.
VALID_FOR_STALE = [(loss, correction) for loss in RATIO_LOSSES for correction in STALE_CORRECTIONS
                   if not (loss.startswith("gspo") and correction == "bypass")]
VALID_FOR_STALE += [("topr", "none"), ("topr", "bypass"), ("reinforce", "vtrace"), ("sppo", "bypass")]
SPPO = {"advantage": "sppo", "loss_agg": "seq-mean-token-mean"}
"""SPPO's loss goes with its own advantage, per-sequence (algos/config.py::AlgoConfig._check_sppo)."""


class OneTokenMicroBatch:
    """The fields of learner.batch.Batch that the objective reads, for [B, 1] one-token sequences."""

    def __init__(self, logprobs_behav, advantages, is_weight=None):
        self.logprobs_behav = logprobs_behav
        self.advantages = advantages
        self.loss_mask = torch.ones_like(logprobs_behav)
        self.versions = torch.zeros_like(logprobs_behav, dtype=torch.int64)
        self.is_weight = is_weight
        self.logprobs_ref = None


def sample_pulls(logits_behav, groups, n, gen):
    probs = torch.softmax(logits_behav, -1)
    arms = torch.multinomial(probs, groups * n, replacement=True, generator=gen)  # [B]
    rewards = torch.bernoulli(ARM_MEANS[arms], generator=gen)  # [B]
    return arms, rewards, torch.log(probs[arms])


def bandit_step(logits, logits_behav, algo, gen, groups=8, n=8):
    plan = OffPolicyPlan.from_algo(algo)
    arms, rewards, behav = sample_pulls(logits_behav, groups, n, gen)
    logprobs = torch.log_softmax(logits, -1)[arms][:, None]  # [B, 1], with grad
    behav = behav[:, None]
    mask = torch.ones_like(behav)
    if plan.vtrace_advantages:
        advantages = compute_vtrace_advantages(logprobs.detach(), behav, mask, rewards - rewards.mean(), None)
    else:
        inputs = AdvantageInputs(token_rewards=rewards[:, None], loss_mask=mask, group_size=n)
        advantages = compute_token_advantages(algo.advantage, inputs, sppo_target=algo.sppo_target)
    micro = OneTokenMicroBatch(behav, advantages)
    if plan.weight_source == WEIGHT_BATCH:  # m2po: once on the whole batch, as the train step does
        micro.is_weight, _ = compute_correction(plan.weight_correction, logprobs.detach(), behav, mask,
                                                **plan.weight_kwargs)
    counts = StepCounts(tokens=float(mask.sum()), seqs=float(mask.shape[0]))
    loss, *_ = compute_micro_loss(plan, algo, logprobs, logprobs.detach(), micro, counts, 0.0,
                                  torch.Generator().manual_seed(0))
    return loss


@pytest.mark.parametrize("loss, correction", VALID_FOR_STALE)
def test_stale_bandit_converges_to_the_best_arm(loss, correction):
    kwargs = {"cov_ratio": 0.2} if loss in ("clip_cov", "kl_cov") else SPPO if loss == "sppo" else {}
    algo = AlgoConfig(loss=loss, correction=correction, **kwargs)
    gen = torch.Generator().manual_seed(7)
    logits = torch.zeros(len(ARM_MEANS), dtype=F64, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.05)
    history = [logits.detach().clone()]
    for _ in range(300):
        behaviour = history[max(0, len(history) - 1 - STALENESS)]
        optimizer.zero_grad()
        bandit_step(logits, behaviour, algo, gen).backward()
        optimizer.step()
        history.append(logits.detach().clone())
    best_prob = float(torch.softmax(logits.detach(), -1)[BEST])
    assert best_prob > 0.9, f"{loss}+{correction}: π(best arm) = {best_prob:.3f}"


def test_stale_bandit_converges_on_sppos_bradley_terry_preferences():
    """SPPO as the paper runs it, each pull's target its Bradley–Terry win rate against its group's pulls less ½
    (algo.sppo_target=bradley_terry; the rewards read as a reward model's scores), from 3-step-stale data."""
    algo = AlgoConfig(loss="sppo", correction="bypass", sppo_target="bradley_terry", **SPPO)
    gen = torch.Generator().manual_seed(7)
    logits = torch.zeros(len(ARM_MEANS), dtype=F64, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.05)
    history = [logits.detach().clone()]
    for _ in range(300):
        optimizer.zero_grad()
        bandit_step(logits, history[max(0, len(history) - 1 - STALENESS)], algo, gen).backward()
        optimizer.step()
        history.append(logits.detach().clone())
    best_prob = float(torch.softmax(logits.detach(), -1)[BEST])
    assert best_prob > 0.9, f"sppo bradley_terry: π(best arm) = {best_prob:.3f}"


def per_sample_gradients(logits, arms, weights):
    """−∇ of −w·R·log π(a) per sample, i.e. w·R·(e_a − π): shape [N, K]."""
    probs = torch.softmax(logits, -1)
    onehot = torch.nn.functional.one_hot(arms, len(probs)).to(F64)
    return weights[:, None] * (onehot - probs[None, :])


@pytest.mark.parametrize("correction, corrected", [("decoupled", True), ("none", False)])
def test_corrected_gradient_matches_the_exact_on_policy_gradient(correction, corrected):
    gen = torch.Generator().manual_seed(3)
    logits = torch.tensor([0.5, -0.3, 0.1, 0.8, -0.6], dtype=F64)
    logits_behav = torch.tensor([-0.4, 0.6, 0.2, -0.2, 0.3], dtype=F64)  # a much older policy
    probs = torch.softmax(logits, -1)
    exact = probs * ARM_MEANS - probs * (probs * ARM_MEANS).sum()  # ∇_z Σ_a π(a) r(a)

    arms, rewards, behav = sample_pulls(logits_behav, groups=1, n=200_000, gen=gen)
    theta = logits.clone().requires_grad_(True)
    logprobs = torch.log_softmax(theta, -1)[arms][:, None]
    mask = torch.ones_like(logprobs)
    algo = AlgoConfig(loss="reinforce", correction=correction, **({"is_cap": 1e6} if corrected else {}))
    micro = OneTokenMicroBatch(behav[:, None], rewards[:, None].to(F64))
    counts = StepCounts(tokens=float(mask.sum()), seqs=float(mask.shape[0]))
    loss, *_ = compute_micro_loss(OffPolicyPlan.from_algo(algo), algo, logprobs, logprobs.detach(), micro, counts, 0.0)
    (grad,) = torch.autograd.grad(loss, theta)
    estimate = -grad

    weights = torch.exp(logprobs.detach()[:, 0] - behav) if corrected else torch.ones_like(behav)
    samples = per_sample_gradients(logits, arms, weights * rewards)
    torch.testing.assert_close(estimate, samples.mean(0), rtol=0, atol=1e-10)  # the loss is that estimator
    stderr = samples.std(0) / math.sqrt(samples.shape[0])
    z = ((estimate - exact).abs() / stderr).max()
    if corrected:
        assert z < 5, f"corrected estimate is {z:.1f} standard errors from the exact gradient"
    else:
        assert z > 10, f"uncorrected estimate should be biased, but is within {z:.1f} standard errors"


def test_the_bandit_covers_every_registered_loss():
    assert set(RATIO_LOSSES) | {"topr", "sppo"} == set(POLICY_LOSSES)
