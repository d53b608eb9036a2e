"""Golden fp64 tests for every policy loss of asyncrl.algos.losses (docs/algorithms.md §5: T1, T4, T6, T8, T15,
plus a hand-computed case per loss away from identity). The PPO case table (T2), the aggregation
weights and the PPO micro-batch/data-parallel test (T5) are in test_algos.py."""
import inspect
import math

import pytest
import torch

from asyncrl.algos import losses
from asyncrl.algos.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossInputs,
    aggregate_loss,
    cispo_loss,
    clip_cov_loss,
    gmpo_loss,
    sppo_loss,
    gpg_loss,
    gspo_loss,
    gspo_token_loss,
    kl_cov_loss,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
    topr_loss,
)
from asyncrl.algos.metrics import combine_token_metrics
from asyncrl.algos.registry import LOSSES, keyword_defaults
from tests.algos_helpers import F64, counts, make_batch, token_logprobs

ALL_LOSSES = sorted(POLICY_LOSSES)
COV_LOSSES = ("clip_cov", "kl_cov")  # select tokens over the whole call


def call(name, logprobs, prox, advantages, mask, *, logprobs_behav=None, is_weight=None, **hyperparameters):
    """Any loss through its typed input: behaviour logprobs default to prox, and a seeded generator (read by
    clip_cov only) makes the call reproducible."""
    inputs = PolicyLossInputs(logprobs, prox, advantages, mask, is_weight=is_weight,
                              logprobs_behav=prox if logprobs_behav is None else logprobs_behav,
                              generator=torch.Generator().manual_seed(0))
    return POLICY_LOSSES[name](inputs, **hyperparameters)


def grad_of(value, wrt):
    (grad,) = torch.autograd.grad(value, wrt, retain_graph=True)
    return grad


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def t(rows):
    return torch.tensor(rows, dtype=F64)


# Registry ---------------------------------------------------------------------------------------------------
def test_registry_holds_exactly_the_catalogue():
    assert set(POLICY_LOSSES) == set(LOSSES) == {"ppo", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "gpg",
                                                 "clip_cov", "kl_cov", "topr", "reinforce", "sppo"}
    assert POLICY_LOSSES["ppo"] is ppo_clip_loss and POLICY_LOSSES["gspo_token"] is gspo_token_loss


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_registry_entry_names_a_loss_whose_keywords_are_exactly_its_hyperparameters(name):
    spec = LOSSES[name]
    function = getattr(losses, spec.function)
    assert POLICY_LOSSES[name] is function
    params = inspect.signature(function).parameters
    assert list(params) == ["inputs", *keyword_defaults(function)]  # the typed input, then keywords only
    assert set(keyword_defaults(function)) == set(spec.fields.values())


def test_published_defaults():
    defaults = {name: keyword_defaults(fn) for name, fn in POLICY_LOSSES.items()}
    assert defaults["ppo"] == {"clip_low": 0.2, "clip_high": 0.28, "dual_clip_c": None}
    assert defaults["gspo"] == defaults["gspo_token"] == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert defaults["sapo"] == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert defaults["cispo"]["clip_low"] is None
    assert defaults["clip_cov"] == {"clip_low": 1.0, "clip_high": 1.0, "cov_ratio": 2e-4, "cov_low": 1.0,
                                    "cov_high": 5.0}
    assert defaults["kl_cov"] == {"cov_ratio": 2e-3, "kl_coef": 1.0}
    assert defaults["gpg"] == defaults["topr"] == defaults["reinforce"] == {}


# T1 ---------------------------------------------------------------------------------------------------------
def _sapo_identity_value(a, lp):
    tau = torch.where(a > 0, torch.full_like(a, 1.0), torch.full_like(a, 1.05))
    return -(2.0 / tau) * a  # (4/τ) σ(0) = 2/τ


VALUE_AT_IDENTITY = {  # per-token loss at ℓθ = ℓprox = ℓμ, from (A, ℓθ)
    "ppo": lambda a, lp: -a,
    "gspo": lambda a, lp: -a,
    "gspo_token": lambda a, lp: -a,
    "kl_cov": lambda a, lp: -a,  # the |ℓθ - ℓprox| penalty is 0
    "cispo": lambda a, lp: -a * lp,
    "gpg": lambda a, lp: -a * lp,
    "reinforce": lambda a, lp: -a * lp,
    "topr": lambda a, lp: -a * lp,  # negatives weighted by min(1, e^0) = 1
    "sapo": _sapo_identity_value,
}


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(VALUE_AT_IDENTITY))
def test_identity_policies_give_the_expected_value_and_the_reinforce_gradient(name, mode):
    z, tokens, mask, advantages, _ = make_batch()
    logprobs = token_logprobs(z, tokens)
    same = logprobs.detach()
    loss_t, metrics = call(name, logprobs, same, advantages, mask, logprobs_behav=same.clone(),
                           is_weight=mask.clone())  # an identity correction weight (w == 1) changes nothing
    loss = aggregate_loss(loss_t, mask, mode, **counts(mask))
    want = aggregate_loss(VALUE_AT_IDENTITY[name](advantages, same), mask, mode, **counts(mask))
    close(loss, want)
    reinforce = aggregate_loss(-advantages * logprobs, mask, mode, **counts(mask))
    close(grad_of(loss, z), grad_of(reinforce, z))
    assert float(metrics["policy/ratio_mean"]) == 1.0 and float(metrics["policy/ppo_kl"]) == 0.0
    for key in ("policy/clip_frac_low", "policy/clip_frac_high", "policy/dual_clip_frac",
                "policy/topr_truncated_frac", "policy/abs_kl", "policy/seq_log_ratio_abs/max"):
        assert float(metrics.get(key, 0.0)) == 0.0
    for key in ("policy/sapo_grad_scale", "policy/cispo_weight_mean", "policy/seq_ratio_mean",
                "policy/topr_weight_mean"):
        assert float(metrics.get(key, 1.0)) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_clip_cov_at_identity_is_reinforce_without_the_selected_tokens(mode):
    z, tokens, mask, advantages, _ = make_batch()
    logprobs = token_logprobs(z, tokens)
    same = logprobs.detach()
    # A band that admits every token and cov_ratio 0.2: floor(0.2 * 27) = 5 tokens are dropped.
    inputs = PolicyLossInputs(logprobs, same, advantages, mask, generator=torch.Generator().manual_seed(3))
    loss_t, metrics = clip_cov_loss(inputs, cov_ratio=0.2, cov_low=-1e9, cov_high=1e9)
    kept = (mask.bool() & (loss_t != 0)).to(F64)  # A != 0 on every valid token, so loss 0 marks the selection
    assert float(metrics["policy/cov_selected_frac_sum"]) == 5 == float((mask - kept).sum())
    close(aggregate_loss(loss_t, mask, mode, **counts(mask)),
          aggregate_loss(-advantages * kept, mask, mode, **counts(mask)))
    want = aggregate_loss(-advantages * logprobs * kept, mask, mode, **counts(mask))
    close(grad_of(aggregate_loss(loss_t, mask, mode, **counts(mask)), z), grad_of(want, z))
    # With a band no covariance reaches, nothing is dropped: plain PPO, i.e. -A and the REINFORCE gradient.
    plain_t, plain_metrics = clip_cov_loss(PolicyLossInputs(logprobs, same, advantages, mask), cov_low=1e8,
                                           cov_high=1e9)
    plain = aggregate_loss(plain_t, mask, mode, **counts(mask))
    close(plain, aggregate_loss(-advantages, mask, mode, **counts(mask)))
    close(grad_of(plain, z), grad_of(aggregate_loss(-advantages * logprobs, mask, mode, **counts(mask)), z))
    assert float(plain_metrics["policy/cov_selected_frac"]) == 0.0


# T4 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_gradient_on_logits_at_identity_is_minus_advantage_times_score(name):
    z = torch.tensor([0.3, -1.2, 2.0], dtype=F64, requires_grad=True)
    logprob = torch.log_softmax(z, -1)[0].reshape(1, 1)  # action a = 0
    loss_t, _ = call(name, logprob, logprob.detach(), torch.full((1, 1), 2.0, dtype=F64), torch.ones(1, 1))
    want = -2.0 * (torch.tensor([1.0, 0.0, 0.0], dtype=F64) - torch.softmax(z.detach(), -1))
    close(grad_of(loss_t.sum(), z), want)


# T6 ---------------------------------------------------------------------------------------------------------
def test_reinforce_with_a_truncated_weight_never_differentiates_the_weight():
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    behav = logprobs.detach() + noise
    live_weight = torch.clamp(torch.exp(logprobs - behav), max=1.2)  # min(ρ̃, C), still attached to the graph
    loss_t, _ = reinforce_loss(PolicyLossInputs(logprobs, behav, advantages, mask, is_weight=live_weight))
    n = mask.sum()
    want = -(live_weight.detach() * advantages * logprobs * mask).sum() / n  # Σ sg(min(ρ̃, C)) A ∇ℓθ / N
    close(grad_of(loss_t.sum() / n, z), grad_of(want, z))
    attached = -(live_weight * advantages * logprobs * mask).sum() / n
    assert (grad_of(attached, z) - grad_of(want, z)).abs().max() > 1e-3


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_every_loss_detaches_the_correction_weight(name):
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    prox = logprobs.detach() + 0.1 * noise
    live_weight = torch.exp(0.5 * (logprobs - prox))  # depends on θ: a leak would change the gradient
    with_live, _ = call(name, logprobs, prox, advantages, mask, is_weight=live_weight)
    with_detached, _ = call(name, logprobs, prox, advantages, mask, is_weight=live_weight.detach())
    close(with_live, with_detached)
    close(grad_of(with_live.sum(), z), grad_of(with_detached.sum(), z))


# T8: GSPO ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [10, 100, 1000])
@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_sequence_ratio_is_the_geometric_mean_whatever_the_length(name, length):
    delta = 0.01
    prox = torch.full((1, length), -1.0, dtype=F64)
    logprobs = (prox + delta).requires_grad_()
    mask = torch.ones(1, length, dtype=F64)
    loss_t, metrics = call(name, logprobs, prox, -torch.ones(1, length, dtype=F64), mask)
    # s = (Π_t e^δ)^(1/T) = e^δ, while the plain product e^{Tδ} grows with T. With A = -1 and s > 1 the
    # unclipped branch is the max, so every token's loss is s itself.
    product = torch.exp(torch.full((length,), delta, dtype=F64)).prod()
    assert float(product) == pytest.approx(math.exp(length * delta), rel=1e-12)
    close(loss_t, torch.full((1, length), math.exp(delta), dtype=F64))
    assert float(metrics["policy/seq_ratio_mean"]) == pytest.approx(math.exp(delta), abs=1e-12)
    assert float(metrics["policy/seq_log_ratio_abs/max"]) == pytest.approx(delta, abs=1e-12)
    # d(Σ_t L_t)/dℓθ_u = s: GSPO spreads T copies of s/T, GSPO-token gives each token s directly.
    close(grad_of(loss_t.sum(), logprobs), torch.full((1, length), math.exp(delta), dtype=F64))


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_gspo_token_gradient_equals_gspo_gradient_for_sequence_constant_advantages(mode):
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    prox = logprobs.detach() + 0.003 * noise  # |log s| ~ 1e-3: some sequences clipped, some not
    seq, seq_metrics = gspo_loss(PolicyLossInputs(logprobs, prox, advantages, mask))
    tok, _ = gspo_token_loss(PolicyLossInputs(logprobs, prox, advantages, mask))
    close(seq, tok)
    seq_loss = aggregate_loss(seq, mask, mode, **counts(mask))
    tok_loss = aggregate_loss(tok, mask, mode, **counts(mask))
    grad = grad_of(seq_loss, z)
    close(grad, grad_of(tok_loss, z))
    clipped = float(seq_metrics["policy/clip_frac_low"] + seq_metrics["policy/clip_frac_high"])
    assert 0 < clipped < 1 and grad.abs().max() > 1e-3


def test_gspo_golden_sequence_ratio_and_clipping():
    prox = t([[-1.0, -2.0]])
    logprobs = (prox + t([[0.1, -0.3]])).requires_grad_()
    mask = torch.ones(1, 2, dtype=F64)
    s = math.exp(-0.1)  # geometric mean of e^0.1 and e^-0.3
    loss_t, metrics = gspo_loss(PolicyLossInputs(logprobs, prox, torch.ones(1, 2, dtype=F64), mask))
    close(loss_t, [[-s, -s]])  # A > 0, s < 1: unclipped
    close(grad_of(loss_t.sum(), logprobs), [[-s, -s]])  # each token: 2 copies of -s/2
    loss_t, metrics = gspo_loss(PolicyLossInputs(logprobs, prox, -torch.ones(1, 2, dtype=F64), mask))
    close(loss_t, [[1 - 3e-4, 1 - 3e-4]])  # A < 0, s < 1 - 3e-4: clipped, no gradient
    close(grad_of(loss_t.sum(), logprobs), [[0.0, 0.0]])
    assert float(metrics["policy/clip_frac_low"]) == 1.0
    loss_t, _ = gspo_loss(PolicyLossInputs(logprobs, prox, -torch.ones(1, 2, dtype=F64), mask), clip_low=0.2)
    close(loss_t, [[s, s]])  # a wide range leaves s unclipped


def test_gmpo_golden_geometric_mean_of_log_space_clipped_ratios():
    prox = t([[-1.0, -2.0, -1.5]])
    logprobs = (prox + t([[0.5, -0.1, -0.6]])).requires_grad_()
    mask = torch.ones(1, 3, dtype=F64)
    # A > 0: min(log u, clip(log u, -0.4, 0.4)) = [0.4, -0.1, -0.6]; only 0.5 is clipped
    g = math.exp((0.4 - 0.1 - 0.6) / 3)
    loss_t, metrics = gmpo_loss(PolicyLossInputs(logprobs, prox, torch.full((1, 3), 2.0, dtype=F64), mask))
    close(loss_t, [[-2 * g] * 3])
    close(grad_of(loss_t.sum(), logprobs), [[0.0, -2 * g, -2 * g]])  # 3 copies of -2g/3 on each unclipped token
    assert float(metrics["policy/clip_frac_high"]) == pytest.approx(1 / 3)
    # A < 0: max(log u, clip) = [0.5, -0.1, -0.4]; only -0.6 is clipped
    g = math.exp((0.5 - 0.1 - 0.4) / 3)
    loss_t, metrics = gmpo_loss(PolicyLossInputs(logprobs, prox, -torch.ones(1, 3, dtype=F64), mask))
    close(loss_t, [[g] * 3])
    close(grad_of(loss_t.sum(), logprobs), [[g, g, 0.0]])
    assert float(metrics["policy/clip_frac_low"]) == pytest.approx(1 / 3)
    # a wide range clips nothing: the plain geometric mean of the ratios
    loss_t, _ = gmpo_loss(PolicyLossInputs(logprobs, prox, -torch.ones(1, 3, dtype=F64), mask), clip_low=1.0,
                          clip_high=1.0)
    close(loss_t, [[math.exp(-0.2 / 3)] * 3])


def test_gspo_token_gives_each_token_its_own_advantage_with_the_sequence_ratio():
    prox = t([[-1.0, -2.0]])
    logprobs = (prox + t([[0.1, -0.3]])).requires_grad_()
    mask, advantages = torch.ones(1, 2, dtype=F64), t([[1.0, -1.0]])
    s = math.exp(-0.1)
    tok, _ = gspo_token_loss(PolicyLossInputs(logprobs, prox, advantages, mask))
    close(tok, [[-s, 1 - 3e-4]])  # token 1 (A < 0, s < 1 - ε_low) is clipped
    close(grad_of(tok.sum(), logprobs), [[-s, 0.0]])
    seq, _ = gspo_loss(PolicyLossInputs(logprobs, prox, advantages, mask))
    close(seq, [[-s, 1 - 3e-4]])
    close(grad_of(seq.sum(), logprobs), [[-s / 2, -s / 2]])  # token 0's loss moves the whole sequence


def test_sppo_golden_regresses_each_sequence_log_ratio_onto_eta_times_its_target():
    """verl's compute_sppo_loss on a hand case, halved: ρ = Σ_t (ℓθ - ℓμ) = [0.2, -0.1], targets s = R - SM_1(R)
    for R = [1, 0] (SM_1 = ln((e + 1)/2)), so L = mean_i ½ (ρ_i - s_i)² = 0.1514389 / 2 and ∂L/∂ρ_i = (ρ_i - s_i) / 2
    (two rows), the same on every token of a row; padding takes no part."""
    centre = t([[-1.1, -2.1], [-0.4, 0.0]])
    logprobs = t([[-1.0, -2.0], [-0.5, -9.0]]).requires_grad_()
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    soft_mean = math.log((math.e + 1) / 2)
    s = [1 - soft_mean, -soft_mean]  # [0.3798855, -0.6201145]
    advantages = t([[s[0], s[0]], [s[1], 0.0]])
    loss_t, metrics = sppo_loss(PolicyLossInputs(logprobs, centre, advantages, mask))
    residual = [0.2 - s[0], -0.1 - s[1]]
    close(loss_t, [[residual[0] ** 2 / 2] * 2, [residual[1] ** 2 / 2, 0.0]])
    total = aggregate_loss(loss_t, mask, "seq-mean-token-mean", **counts(mask))
    assert float(total) == pytest.approx(0.1514389 / 2, abs=1e-7)  # verl's 0.1514389, halved
    close(grad_of(total, logprobs), [[residual[0] / 2] * 2, [residual[1] / 2, 0.0]])
    assert float(metrics["policy/sppo_residual_abs"]) == pytest.approx((2 * abs(residual[0]) + abs(residual[1])) / 3)
    # η scales the target; at ρ = 0 (the first pass over fresh samples) the gradient is -η s / B: REINFORCE with η s
    at_centre = centre.clone().requires_grad_()
    loss_t, _ = sppo_loss(PolicyLossInputs(at_centre, centre, advantages, mask), eta=2.0)
    close(grad_of(aggregate_loss(loss_t, mask, "seq-mean-token-mean", **counts(mask)), at_centre),
          [[-s[0]] * 2, [-s[1], 0.0]])
    with pytest.raises(ValueError, match="eta must be > 0"):
        sppo_loss(PolicyLossInputs(logprobs, centre, advantages, mask), eta=0.0)


# Golden cases away from identity -----------------------------------------------------------------------------
def test_ppo_default_clip_high_is_dapo_clip_higher():
    logprobs = torch.log(t([[1.25, 1.3]])).requires_grad_()
    inputs = PolicyLossInputs(logprobs, torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64), torch.ones(1, 2))
    loss_t, metrics = ppo_clip_loss(inputs)
    close(loss_t, [[-1.25, -1.28]])
    close(grad_of(loss_t.sum(), logprobs), [[-1.25, 0.0]])
    assert float(metrics["policy/clip_frac_high"]) == 0.5


def test_ppo_dual_clip_caps_negative_advantages_only():
    logprobs = torch.log(t([[5.0, 5.0]])).requires_grad_()
    loss_t, metrics = ppo_clip_loss(PolicyLossInputs(logprobs, torch.zeros(1, 2, dtype=F64), t([[1.0, -1.0]]),
                                                     torch.ones(1, 2)), dual_clip_c=3.0)
    close(loss_t, [[-1.28, 3.0]])  # A > 0: ordinary clip; A < 0: -r A = 5 capped at -c A = 3
    close(grad_of(loss_t.sum(), logprobs), [[0.0, 0.0]])
    assert float(metrics["policy/dual_clip_frac"]) == 0.5


CISPO_RATIOS, CISPO_ADV = [1.5, 0.3, 1.1, 5.0], [1.0, -1.0, 1.0, 1.0]


@pytest.mark.parametrize("kwargs, weights, frac_low, frac_high", [
    (dict(clip_low=0.2, clip_high=0.28), [1.28, 0.8, 1.1, 1.28], 0.25, 0.5),
    (dict(), [1.5, 0.3, 1.1, 4.0], 0.0, 0.25),  # default: no lower bound, weight capped at 1 + 3
])
def test_cispo_clips_the_weight_but_keeps_every_gradient(kwargs, weights, frac_low, frac_high):
    prox = t([[-2.0, -1.0, -0.5, -3.0]])
    logprobs = (prox + torch.log(t([CISPO_RATIOS]))).requires_grad_()
    advantages, mask = t([CISPO_ADV]), torch.ones(1, 4)
    loss_t, metrics = cispo_loss(PolicyLossInputs(logprobs, prox, advantages, mask), **kwargs)
    w, a = t([weights]), t([CISPO_ADV])
    close(loss_t, -w * a * logprobs.detach())
    close(grad_of(loss_t.sum(), logprobs), -w * a)  # nonzero on every token
    assert float(metrics["policy/clip_frac_low"]) == frac_low and float(metrics["policy/clip_frac_high"]) == frac_high
    # PPO on the same tokens: the clipped branch is active on tokens 0, 1, 3 and their gradient is exactly 0.
    ppo_t, _ = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask), clip_low=0.2, clip_high=0.28)
    close(grad_of(ppo_t.sum(), logprobs), [[0.0, 0.0, -1.1, 0.0]])


def test_sapo_soft_gate_with_separate_temperatures():
    ratios, adv = [1.0, 1.0, 1.2, 1.2, 0.7], [1.0, -1.0, 1.0, -1.0, -1.0]
    logprobs = torch.log(t([ratios])).requires_grad_()
    prox, mask = torch.zeros(1, 5, dtype=F64), torch.ones(1, 5)
    loss_t, metrics = sapo_loss(PolicyLossInputs(logprobs, prox, t([adv]), mask))
    close(loss_t[0, :2], [-2.0, 2.0 / 1.05])  # at r = 1 the gate is 2/τ
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))
    taus = [1.0, 1.05, 1.0, 1.05, 1.05]
    close(loss_t[0], [-(4 / tau) * sig(tau * (r - 1)) * a for r, a, tau in zip(ratios, adv, taus)])
    slope = [4 * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1))) * r for r, tau in zip(ratios, taus)]
    close(grad_of(loss_t.sum(), logprobs)[0], [-s * a for s, a in zip(slope, adv)])
    assert float(metrics["policy/sapo_grad_scale"]) == pytest.approx(sum(slope) / 5, abs=1e-12)
    hot, _ = sapo_loss(PolicyLossInputs(logprobs, prox, t([adv]), mask), tau_pos=2.0, tau_neg=3.0)
    close(hot[0, :2], [-1.0, 2.0 / 3.0])


@pytest.mark.parametrize("loss_fn", [reinforce_loss, gpg_loss])
def test_plain_policy_gradient_ignores_the_ratio(loss_fn):
    logprobs = t([[-0.5, -2.0]]).requires_grad_()
    advantages, mask, w = t([[2.0, -1.0]]), torch.ones(1, 2), t([[0.5, 3.0]])
    for prox in (logprobs.detach(), logprobs.detach() + t([[1.0, -4.0]])):
        loss_t, _ = loss_fn(PolicyLossInputs(logprobs, prox, advantages, mask, is_weight=w))
        close(loss_t, [[0.5, -6.0]])  # -w A ℓθ
        close(grad_of(loss_t.sum(), logprobs), [[-1.0, 3.0]])


def test_topr_truncates_negative_samples_only_by_the_sequence_ratio():
    logprobs = t([[-1.0, -2.0]] * 3).requires_grad_()
    behav = logprobs.detach() - t([[-0.3, -0.4], [-0.3, -0.4], [0.2, 0.3]])  # ℓθ - ℓμ per token
    advantages, mask = t([[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]]), torch.ones(3, 2)
    prox = logprobs.detach() + 1.0  # not read by the formula
    loss_t, metrics = topr_loss(PolicyLossInputs(logprobs, prox, advantages, mask, logprobs_behav=behav))
    w = t([[1.0, 1.0], [math.exp(-0.7)] * 2, [1.0, 1.0]])  # positive: 1; negative: min(1, e^{Σ(ℓθ-ℓμ)})
    close(loss_t, -w * advantages * logprobs.detach())
    close(grad_of(loss_t.sum(), logprobs), -w * advantages)
    assert float(metrics["policy/topr_negative_frac"]) == pytest.approx(4 / 6)
    assert float(metrics["policy/topr_truncated_frac"]) == pytest.approx(2 / 6)
    assert float(metrics["policy/topr_weight_mean"]) == pytest.approx((4 + 2 * math.exp(-0.7)) / 6)
    with pytest.raises(ValueError, match="logprobs_behav"):
        topr_loss(PolicyLossInputs(logprobs, prox, advantages, mask))


# Clip-Cov / KL-Cov: ℓθ - mean = [2, -2, 1, -1] and A - mean(A) chosen so that Cov_t is known exactly.
COV_LOGPROBS = [[-1.0, -5.0, -2.0, -4.0]]  # mean -3


def test_clip_cov_zeroes_exactly_the_sampled_tokens_in_the_covariance_band():
    logprobs = t(COV_LOGPROBS).requires_grad_()
    advantages, mask = t([[1.5, -1.5, 0.5, -0.5]]), torch.ones(1, 4)  # Cov = [3, 3, 0.5, 0.5]
    prox = logprobs.detach()

    def run(seed, **kwargs):
        inputs = PolicyLossInputs(logprobs, prox, advantages, mask, generator=torch.Generator().manual_seed(seed))
        return clip_cov_loss(inputs, **kwargs)

    loss_t, metrics = run(0, cov_ratio=0.25)  # floor(0.25 * 4) = 1 of the 2 candidates (Cov 3 in (1, 5))
    dropped = int((loss_t[0, :2] == 0).nonzero()[0, 0])
    want = -advantages.clone()
    want[0, dropped] = 0.0
    close(loss_t, want)
    close(grad_of(loss_t.sum(), logprobs), want)  # r = 1: gradient -A, 0 on the dropped token
    assert float(metrics["policy/cov_selected_frac"]) == 0.25 and float(metrics["policy/cov_candidate_frac"]) == 0.5
    assert float(metrics["policy/cov/max"]) == pytest.approx(3.0)
    assert torch.equal(run(0, cov_ratio=0.25)[0], loss_t)  # same generator state, same choice
    assert {int((run(seed, cov_ratio=0.25)[0][0, :2] == 0).nonzero()[0, 0]) for seed in range(20)} == {0, 1}
    close(run(0, cov_ratio=0.5)[0], [[0.0, 0.0, -0.5, 0.5]])  # 2 selected: both candidates
    close(run(0, cov_ratio=0.5, cov_high=2.9)[0], -advantages)  # band (1, 2.9) is empty: plain PPO
    # A token PPO already clipped is never a candidate: r_0 = e > 1 + 1 with A > 0, so of the 2 tokens asked for
    # only token 1 is dropped.
    prox_clipped = prox - t([[1.0, 0.0, 0.0, 0.0]])
    inputs = PolicyLossInputs(logprobs, prox_clipped, advantages, mask, generator=torch.Generator().manual_seed(0))
    loss_t, _ = clip_cov_loss(inputs, cov_ratio=0.5)
    close(loss_t, [[-2.0 * 1.5, 0.0, -0.5, 0.5]])
    close(grad_of(loss_t.sum(), logprobs), [[0.0, 0.0, -0.5, 0.5]])


@pytest.mark.parametrize("cov_ratio, selected", [(0.25, [0]), (0.5, [0, 1])])
def test_kl_cov_penalises_the_top_covariance_tokens_without_clipping(cov_ratio, selected):
    logprobs = t(COV_LOGPROBS).requires_grad_()
    advantages, mask = t([[1.5, -1.0, 0.5, -1.0]]), torch.ones(1, 4)  # Cov = [3, 2, 0.5, 1]
    delta = t([[0.1, -0.2, 0.3, 0.05]])  # ℓθ - ℓprox
    loss_t, metrics = kl_cov_loss(PolicyLossInputs(logprobs, logprobs.detach() - delta, advantages, mask),
                                  cov_ratio=cov_ratio, kl_coef=0.5)
    on = torch.zeros(1, 4, dtype=F64)
    on[0, selected] = 1.0
    close(loss_t, -advantages * delta.exp() + 0.5 * on * delta.abs())
    # token 2 has r = e^0.3 > 1.28 with A > 0 and still gets -A r: KL-Cov has no clip
    close(grad_of(loss_t.sum(), logprobs), -advantages * delta.exp() + 0.5 * on * delta.sign())
    assert float(metrics["policy/cov_selected_frac"]) == len(selected) / 4
    assert float(metrics["policy/abs_kl"]) == pytest.approx(0.65 / 4, abs=1e-12)


def test_cov_selection_is_per_call():
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    prox = logprobs.detach() + noise
    _, whole = kl_cov_loss(PolicyLossInputs(logprobs, prox, advantages, mask))  # floor(2e-3 * 27) -> 1 token
    parts = [kl_cov_loss(PolicyLossInputs(logprobs[r], prox[r], advantages[r], mask[r]))[1]
             for r in (slice(0, 2), slice(2, 8))]
    assert float(whole["policy/cov_selected_frac_sum"]) == 1
    assert combine_token_metrics(parts)["policy/cov_selected_frac"] == pytest.approx(2 / 27)


# Micro-batching -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", [n for n in ALL_LOSSES if n not in COV_LOSSES])
def test_micro_batching_does_not_change_token_or_sequence_losses(name, mode):
    z, tokens, mask, advantages, noise = make_batch()
    prox = token_logprobs(z, tokens).detach() + noise
    behav = prox - noise.flip(0)
    results = []
    for layout in ([range(8)], [range(0, 3), range(3, 8)], [range(0, 1), range(1, 3), range(3, 6), range(6, 8)]):
        total, grad, metrics = 0.0, 0.0, []
        for rows in layout:
            idx = torch.tensor(rows)
            loss_t, m = call(name, token_logprobs(z[idx], tokens[idx]), prox[idx], advantages[idx], mask[idx],
                             logprobs_behav=behav[idx])
            loss = aggregate_loss(loss_t, mask[idx], mode, **counts(mask))
            total, grad, metrics = total + loss.item(), grad + grad_of(loss, z), metrics + [m]
        results.append((total, grad, combine_token_metrics(metrics)))
    for total, grad, metrics in results[1:]:
        assert total == pytest.approx(results[0][0], abs=1e-12)
        close(grad, results[0][1], atol=1e-12)
        assert metrics == pytest.approx(results[0][2], abs=1e-12)


# T15 and metric conventions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("all_masked", [False, True])
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_masked_garbage_and_empty_batches_give_finite_loss_grads_and_metrics(name, all_masked):
    z, tokens, mask, advantages, noise = make_batch()
    if all_masked:
        mask = torch.zeros_like(mask)
    valid = mask.bool()
    logprobs = torch.where(valid, token_logprobs(z, tokens), -math.inf)
    prox = logprobs.detach() + 3 * noise
    prox[1, 0] -= 50.0  # a ratio of e^50 on a valid token: clamped, not overflowed
    prox = torch.where(valid, prox, -math.inf)
    behav = torch.where(valid, prox - noise, math.nan)
    advantages = torch.where(valid, advantages, math.nan)
    is_weight = torch.where(valid, 1.5, math.nan)
    loss_t, metrics = call(name, logprobs, prox, advantages, mask, is_weight=is_weight, logprobs_behav=behav)
    assert torch.equal(loss_t[~valid], torch.zeros_like(loss_t[~valid]))
    for mode in LOSS_AGGREGATIONS:
        loss = aggregate_loss(loss_t, mask, mode, **counts(mask))
        grad = grad_of(loss, z)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        if all_masked:
            assert loss.item() == 0.0 and not grad.any()
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert all(math.isfinite(v) for v in combine_token_metrics([metrics]).values())


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_metrics_are_detached_scalars_in_the_combinable_convention(name):
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    _, metrics = call(name, logprobs, logprobs.detach() + noise, advantages, mask)
    assert metrics["policy/tokens"] == mask.sum()
    for key, value in metrics.items():
        assert key.startswith("policy/") and value.dim() == 0 and not value.requires_grad
    combine_token_metrics([metrics, metrics])  # raises on a key without a combination rule


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_bf16_inputs_are_computed_in_fp32(name):
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens).to(torch.bfloat16)
    loss_t, _ = call(name, logprobs, (logprobs.detach().double() + noise).to(torch.bfloat16),
                     advantages.to(torch.bfloat16), mask)
    assert loss_t.dtype == torch.float32 and torch.isfinite(loss_t).all()


@pytest.mark.parametrize("loss_fn, kwargs, match", [
    (ppo_clip_loss, dict(clip_low=-0.1), "clip_low"),
    (ppo_clip_loss, dict(dual_clip_c=1.0), "dual_clip_c"),
    (gspo_loss, dict(clip_high=-1.0), "clip_high"),
    (gspo_token_loss, dict(clip_low=-1.0), "clip_low"),
    (cispo_loss, dict(clip_high=-1.0), "clip_high"),
    (sapo_loss, dict(tau_neg=0.0), "tau"),
    (clip_cov_loss, dict(cov_low=5.0, cov_high=1.0), "cov_low"),
    (clip_cov_loss, dict(cov_ratio=0.0), "cov_ratio"),
    (kl_cov_loss, dict(cov_ratio=1.5), "cov_ratio"),
    (kl_cov_loss, dict(kl_coef=-1.0), "kl_coef"),
])
def test_invalid_hyperparameters_are_rejected(loss_fn, kwargs, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        loss_fn(PolicyLossInputs(x, x, x, torch.ones(1, 2)), **kwargs)
