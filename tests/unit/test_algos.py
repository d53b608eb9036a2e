"""Golden fp64 tests for asyncrl.algos (docs/algorithms.md §5: T1-T5, T7, T9, §3 metrics, T15)."""
import math

import pytest
import torch

from asyncrl.algos.advantages import ADVANTAGES, compute_grpo_advantages
from asyncrl.algos.corrections import CORRECTION_WEIGHTS, compute_correction
from asyncrl.algos.losses import LOSS_AGGREGATIONS, POLICY_LOSSES, PolicyLossInputs, aggregate_loss, ppo_clip_loss
from asyncrl.algos.metrics import combine_token_metrics, compute_entropy_from_logits, compute_offpolicy_metrics
from tests.algos_helpers import F64, counts, make_batch, token_logprobs


# T1 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("correction", ["none", "decoupled"])
def test_identity_policies_give_minus_aggregated_advantage_and_reinforce_gradient(mode, correction):
    z, tokens, mask, advantages, _ = make_batch()
    logprobs = token_logprobs(z, tokens)
    same = logprobs.detach()
    is_weight, _ = compute_correction(correction, same, same, mask)
    if is_weight is not None:
        assert torch.equal(is_weight, mask)  # w == 1 exactly on valid tokens
    loss_t, metrics = ppo_clip_loss(PolicyLossInputs(logprobs, same, advantages, mask, is_weight=is_weight),
                                    clip_high=0.28, dual_clip_c=3.0)
    loss = aggregate_loss(loss_t, mask, mode, **counts(mask))
    torch.testing.assert_close(loss, aggregate_loss(-advantages, mask, mode, **counts(mask)), rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(loss, z, retain_graph=True)
    (grad_reinforce,) = torch.autograd.grad(aggregate_loss(-advantages * logprobs, mask, mode, **counts(mask)), z)
    torch.testing.assert_close(grad, grad_reinforce, rtol=0, atol=1e-12)
    for key in ("policy/clip_frac_low", "policy/clip_frac_high", "policy/dual_clip_frac", "policy/ppo_kl"):
        assert float(metrics[key]) == 0.0
    assert float(metrics["policy/ratio_mean"]) == 1.0


# T2 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "adv, ratio, clip_high, dual_c, want_loss, grad_zero, want_flags",
    [
        (1.0, 1.3, 0.2, None, -1.2, True, (0, 1, 0)),  # clipped above
        (1.0, 0.5, 0.2, None, -0.5, False, (0, 0, 0)),  # A > 0 never clips below
        (-1.0, 0.7, 0.2, None, 0.8, True, (1, 0, 0)),  # clipped below
        (-1.0, 1.5, 0.2, None, 1.5, False, (0, 0, 0)),  # A < 0 never clips above
        (-1.0, 5.0, 0.2, 3.0, 3.0, True, (0, 0, 1)),  # dual clip caps at -c A
        (-1.0, 5.0, 0.2, None, 5.0, False, (0, 0, 0)),  # without dual clip the loss is unbounded
        (1.0, 1.25, 0.28, None, -1.25, False, (0, 0, 0)),  # clip-higher: 1.25 < 1.28 is inside
        (1.0, 1.3, 0.28, None, -1.28, True, (0, 1, 0)),  # ...and clips at 1.28, not 1.2
        (1.0, 1.25, 0.2, None, -1.2, True, (0, 1, 0)),
    ],
)
def test_ppo_clip_table(adv, ratio, clip_high, dual_c, want_loss, grad_zero, want_flags):
    logprobs = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    prox, mask = torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64)
    loss, metrics = ppo_clip_loss(PolicyLossInputs(logprobs, prox, torch.full((1, 1), adv, dtype=F64), mask),
                                  clip_low=0.2, clip_high=clip_high, dual_clip_c=dual_c)
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    want_grad = 0.0 if grad_zero else -adv * ratio  # dL/dℓθ = -A u on the unclipped branch
    assert grad.item() == pytest.approx(want_grad, abs=1e-12)
    flags = tuple(int(metrics[k]) for k in ("policy/clip_frac_low", "policy/clip_frac_high", "policy/dual_clip_frac"))
    assert flags == want_flags


# T3 -------------------------------------------------------------------------------------------------------
def test_grpo_advantages_match_verl_convention():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=F64)
    adv = compute_grpo_advantages(rewards)
    torch.testing.assert_close(adv[0], torch.tensor([1, -1, -1, 1], dtype=F64) * 0.5 / (math.sqrt(1 / 3) + 1e-6))
    assert adv[0, 0].item() == pytest.approx(0.86603, abs=1e-5)
    assert torch.equal(adv[1], torch.zeros(4, dtype=F64))  # all-equal group: exactly 0, finite
    dr = compute_grpo_advantages(rewards, norm_by_std=False)
    assert torch.equal(dr, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]], dtype=F64))


def test_grpo_singleton_group_keeps_the_raw_reward():
    rewards = torch.tensor([[3.0], [-1.0]], dtype=F64)
    assert torch.equal(compute_grpo_advantages(rewards), rewards)
    assert torch.equal(compute_grpo_advantages(rewards, norm_by_std=False), rewards)


# T4 -------------------------------------------------------------------------------------------------------
def test_ppo_gradient_on_logits_is_minus_advantage_times_score():
    z = torch.tensor([0.3, -1.2, 2.0], dtype=F64, requires_grad=True)
    logprob = torch.log_softmax(z, -1)[0].reshape(1, 1)  # action a = 0
    loss_t, _ = ppo_clip_loss(PolicyLossInputs(logprob, logprob.detach(), torch.full((1, 1), 2.0, dtype=F64),
                                               torch.ones(1, 1)))
    (grad,) = torch.autograd.grad(aggregate_loss(loss_t, torch.ones(1, 1), "token-mean", global_tokens=1,
                                                 global_seqs=1), z)
    want = -2.0 * (torch.tensor([1.0, 0.0, 0.0], dtype=F64) - torch.softmax(z.detach(), -1))
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode, weights", [
    ("token-mean", (1 / 6, 1 / 6)),
    ("seq-mean-token-mean", (1 / 4, 1 / 8)),
    ("seq-mean-token-sum", (1 / 2, 1 / 2)),
    ("seq-mean-token-sum-norm", (1 / 4, 1 / 4)),
])
def test_aggregation_weight_per_token(mode, weights):
    per_token = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)  # lengths [2, 4]
    (grad,) = torch.autograd.grad(aggregate_loss(per_token, mask, mode, **counts(mask)), per_token)
    want = mask * torch.tensor(weights, dtype=F64)[:, None]
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-15)


def test_aggregation_rejects_unknown_mode_and_missing_constant():
    x, m = torch.ones(1, 1), torch.ones(1, 1)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(x, m, "mean", global_tokens=1, global_seqs=1)
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate_loss(x, m, "seq-mean-token-sum-norm", global_tokens=1, global_seqs=1)


# T5 -------------------------------------------------------------------------------------------------------
def step_loss_and_grad(rows_per_rank, mode, is_weight_mode="truncate", cap=1.3):
    """Simulated dp ranks x micro-batches: accumulate grads, dp-average them, as FSDP/DDP would."""
    z, tokens, mask, advantages, noise = make_batch()
    prox = token_logprobs(z, tokens).detach() + noise
    behav = prox + noise.flip(0)
    totals = counts(mask)  # global over every rank and micro-batch
    dp = len(rows_per_rank)
    loss_sum, metrics = 0.0, []
    for micro_batches in rows_per_rank:
        for rows in micro_batches:
            idx = torch.tensor(rows)
            w, _ = compute_correction("decoupled", prox[idx], behav[idx], mask[idx], cap=cap, mode=is_weight_mode)
            inputs = PolicyLossInputs(token_logprobs(z[idx], tokens[idx]), prox[idx], advantages[idx], mask[idx],
                                      is_weight=w)
            loss_t, m = ppo_clip_loss(inputs, clip_high=0.28, dual_clip_c=3.0)
            loss = aggregate_loss(loss_t, mask[idx], mode, **totals)
            (loss * dp).backward()  # dp-scaled, because the data-parallel all-reduce averages
            loss_sum, metrics = loss_sum + loss.item(), metrics + [m]
    return loss_sum, z.grad / dp, combine_token_metrics(metrics)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("is_weight_mode", ["truncate", "mask"])
def test_micro_batching_and_data_parallel_do_not_change_loss_or_gradient(mode, is_weight_mode):
    layouts = [
        [[range(8)]],  # one micro-batch
        [[range(0, 3), range(3, 8)]],  # 2 micro-batches, 10 vs 17 tokens
        [[range(0, 1), range(1, 3), range(3, 6), range(6, 8)]],  # 4 micro-batches
        [[range(0, 2), range(2, 4)], [range(4, 8)]],  # dp=2, unequal micro-batches per rank
    ]
    ref_loss, ref_grad, ref_metrics = step_loss_and_grad(layouts[0], mode, is_weight_mode)
    for layout in layouts[1:]:
        loss, grad, metrics = step_loss_and_grad(layout, mode, is_weight_mode)
        assert loss == pytest.approx(ref_loss, abs=1e-10)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-10)
        assert metrics == pytest.approx(ref_metrics, abs=1e-12)
    assert ref_metrics["policy/clip_frac_high"] + ref_metrics["policy/clip_frac_low"] > 0  # clipping exercised


def test_naive_per_micro_batch_mean_depends_on_micro_batching():
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    loss_t, _ = ppo_clip_loss(PolicyLossInputs(logprobs, logprobs.detach() + noise, advantages, mask))
    full = aggregate_loss(loss_t, mask, "token-mean", **counts(mask))
    naive = sum(aggregate_loss(loss_t[r], mask[r], "token-mean", **counts(mask[r])) for r in (slice(0, 3), slice(3, 8)))
    assert abs(naive.item() / 2 - full.item()) > 1e-3


def test_rejected_tokens_keep_their_place_in_the_token_count():
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    prox, behav = logprobs.detach(), logprobs.detach() + 2 * noise
    w, m = compute_correction("decoupled", prox, behav, mask, cap=1.1, mode="mask")
    assert 0.2 < float(m["offpolicy/masked_frac"]) < 0.6
    loss_t, _ = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask, is_weight=w))
    loss = aggregate_loss(loss_t, mask, "token-mean", **counts(mask))
    plain, _ = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask))
    torch.testing.assert_close(loss, (w * plain).sum() / mask.sum(), rtol=0, atol=1e-12)


# T9 -------------------------------------------------------------------------------------------------------
def test_decoupled_loss_equals_plain_ppo_when_the_proximal_and_behaviour_logprobs_are_equal():
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    prox = logprobs.detach() + noise
    w, _ = compute_correction("decoupled", prox, prox.clone(), mask, cap=2.0, mode="mask")
    decoupled, _ = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask, is_weight=w), dual_clip_c=3.0)
    plain, _ = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask), dual_clip_c=3.0)
    assert torch.equal(decoupled, plain)
    g_dec, g_plain = (torch.autograd.grad(x.sum(), z, retain_graph=True)[0] for x in (decoupled, plain))
    assert torch.equal(g_dec, g_plain)


def test_constant_is_weight_scales_the_loss_and_gradient():
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    prox = logprobs.detach() + noise
    plain, _ = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask))
    scaled, _ = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask, is_weight=torch.full_like(mask, 2.5)))
    torch.testing.assert_close(scaled, 2.5 * plain, rtol=0, atol=1e-12)
    g_plain, g_scaled = (torch.autograd.grad(x.sum(), z, retain_graph=True)[0] for x in (plain, scaled))
    torch.testing.assert_close(g_scaled, 2.5 * g_plain, rtol=0, atol=1e-12)


def test_no_gradient_reaches_proximal_or_behaviour_logprobs():
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    prox = (logprobs.detach() + noise).requires_grad_()
    behav = (logprobs.detach() - noise).requires_grad_()
    w, _ = compute_correction("decoupled", prox, behav, mask)
    loss_t, _ = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask, is_weight=w))
    assert torch.autograd.grad(loss_t.sum(), [prox, behav], allow_unused=True) == (None, None)


def test_decoupled_gradient_at_the_trust_region_centre_is_weighted_reinforce():
    z, tokens, mask, advantages, noise = make_batch()
    logprobs = token_logprobs(z, tokens)
    w, _ = compute_correction("decoupled", logprobs.detach(), logprobs.detach() + noise, mask)
    loss_t, _ = ppo_clip_loss(PolicyLossInputs(logprobs, logprobs.detach(), advantages, mask, is_weight=w))
    (grad,) = torch.autograd.grad(loss_t.sum() / mask.sum(), z, retain_graph=True)
    (want,) = torch.autograd.grad(-(w * advantages * logprobs * mask).sum() / mask.sum(), z)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


# Corrections (T7 numerics) --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, want, truncated, masked", [
    ("truncate", [0.4, 1.0, 1.5, 2.0, 2.0], 0.4, 0.0),
    ("mask", [0.4, 1.0, 1.5, 0.0, 0.0], 0.0, 0.4),
])
def test_is_weight_truncate_and_mask(mode, want, truncated, masked):
    ratios = [0.4, 1.0, 1.5, 3.0, 10.0]
    behav = torch.tensor([[0.0] * 5 + [-math.inf]], dtype=F64)
    prox = torch.tensor([[math.log(r) for r in ratios] + [-math.inf]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    w, m = compute_correction("decoupled", prox, behav, mask, cap=2.0, mode=mode)
    torch.testing.assert_close(w, torch.tensor([want + [0.0]], dtype=F64), rtol=0, atol=1e-12)
    assert float(m["offpolicy/is_weight/max"]) == pytest.approx(10.0)  # before truncation
    assert float(m["offpolicy/is_weight/mean"]) == pytest.approx(sum(ratios) / 5)
    assert float(m["offpolicy/truncated_frac"]) == pytest.approx(truncated)
    assert float(m["offpolicy/masked_frac"]) == pytest.approx(masked)


def test_no_correction_gives_no_weight_and_unknown_names_are_rejected():
    x = torch.zeros(1, 2)
    assert compute_correction("none", x, x, x) == (None, {})
    with pytest.raises(ValueError, match="unknown correction"):
        compute_correction("no_such_correction", x, x, x)
    with pytest.raises(ValueError, match="mode"):
        compute_correction("decoupled", x, x, x, mode="clamp")


def test_registries_are_plain_dicts():
    assert "grpo" in ADVANTAGES and POLICY_LOSSES["ppo"] is ppo_clip_loss
    assert set(CORRECTION_WEIGHTS) == {"decoupled", "tis", "mis", "seq_mis", "geo_rs", "k3_rs", "icepop", "rs",
                                       "m2po"}


def test_the_rs_family_is_configured_and_refused_where_it_does_not_combine():
    from asyncrl.algos.config import AlgoConfig

    cfg = AlgoConfig(correction="rs", rs_level="sequence", rs_stat="k1", rs_agg="max", rs_low=-0.5, rs_high=0.5)
    assert cfg.correction_kwargs() == {"level": "sequence", "stat": "k1", "agg": "max", "low": -0.5, "high": 0.5}
    for kwargs, match in (({"rs_level": "token", "rs_agg": "sum"}, "judges each token alone"),
                          ({"rs_stat": "k5"}, "rs_stat"), ({"rs_low": 0.3, "rs_high": 0.1}, "low < high")):
        with pytest.raises(ValueError, match=match):
            AlgoConfig(correction="rs", **kwargs)
    with pytest.raises(ValueError, match="does not use it"):
        AlgoConfig(correction="icepop", rs_stat="k2")
    assert AlgoConfig(correction="seq_mis", is_cap=3.0, rs_low=0.25).correction_kwargs() == {"cap": 3.0, "low": 0.25}


# Metrics --------------------------------------------------------------------------------------------------
def test_offpolicy_metrics_are_trivial_for_identical_policies():
    lp = torch.log(torch.tensor([[0.2, 0.5, 0.9]], dtype=F64))
    m = compute_offpolicy_metrics(lp, lp.clone(), torch.ones(1, 3))
    assert {k: m[k] for k in ("offpolicy/mismatch_k1", "offpolicy/mismatch_k3", "offpolicy/abs_diff",
                              "offpolicy/ess", "offpolicy/chi2_token")} == {
        "offpolicy/mismatch_k1": 0.0, "offpolicy/mismatch_k3": 0.0, "offpolicy/abs_diff": 0.0,
        "offpolicy/ess": 1.0, "offpolicy/chi2_token": 0.0}


def test_offpolicy_metrics_hand_computed():
    # ρ = [2, 1, 1] on valid tokens; the 4th position is padding with -inf logprobs.
    behav = torch.tensor([[-1.0, -0.5, -2.0, -math.inf]], dtype=F64)
    prox = behav + torch.tensor([[math.log(2), 0.0, 0.0, 0.0]], dtype=F64)
    m = compute_offpolicy_metrics(prox, behav, torch.tensor([[1, 1, 1, 0]]))
    ln2 = math.log(2)
    assert m["offpolicy/mismatch_k1"] == pytest.approx(-ln2 / 3, abs=1e-12)
    assert m["offpolicy/mismatch_k3"] == pytest.approx((1 - ln2) / 3, abs=1e-12)
    assert m["offpolicy/abs_diff"] == pytest.approx(ln2 / 3, abs=1e-12)
    assert m["offpolicy/ess"] == pytest.approx(16 / 18, abs=1e-12)
    assert m["offpolicy/chi2_token"] == pytest.approx(1.0, abs=1e-12)


def test_entropy_from_logits():
    assert compute_entropy_from_logits(torch.zeros(3, 4)).tolist() == pytest.approx([math.log(4)] * 3)
    z = torch.randn(2, 5, 7, dtype=F64)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(compute_entropy_from_logits(z), -(p * p.log()).sum(-1), rtol=0, atol=1e-12)
    banned = torch.tensor([[0.0, 0.0, -math.inf]], requires_grad=True)
    h = compute_entropy_from_logits(banned)
    assert h.item() == pytest.approx(math.log(2))
    (grad,) = torch.autograd.grad(h.sum(), banned)
    assert torch.isfinite(grad).all()


def test_combine_token_metrics_rejects_keys_without_a_rule():
    with pytest.raises(ValueError, match="policy/entropy"):
        combine_token_metrics([{"policy/entropy": 1.0}])


# T15: NaN guards ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("all_masked", [False, True])
def test_masked_garbage_and_empty_batches_give_finite_loss_and_grads(mode, all_masked):
    z, tokens, mask, advantages, noise = make_batch()
    if all_masked:
        mask = torch.zeros_like(mask)
    valid = mask.bool()
    logprobs = torch.where(valid, token_logprobs(z, tokens), -math.inf)
    prox = torch.where(valid, logprobs.detach() + noise, -math.inf)
    behav = torch.where(valid, prox - noise, -math.inf)
    advantages = torch.where(valid, advantages, math.nan)
    w, wm = compute_correction("decoupled", prox, behav, mask, mode="mask")
    loss_t, lm = ppo_clip_loss(PolicyLossInputs(logprobs, prox, advantages, mask, is_weight=w), dual_clip_c=3.0)
    loss = aggregate_loss(loss_t, mask, mode, **counts(mask))
    (grad,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(float(v)) for v in {**wm, **lm}.values())
    assert all(math.isfinite(v) for v in compute_offpolicy_metrics(prox, behav, mask).values())
    if all_masked:
        assert loss.item() == 0.0 and compute_offpolicy_metrics(prox, behav, mask)["offpolicy/ess"] == 1.0


def test_mult_prob_error_is_the_mean_of_exp_abs_delta_over_valid_tokens():
    from asyncrl.algos.metrics import compute_mult_prob_error

    learner = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, 0.0]])
    behav = torch.tensor([[-1.5, -2.0, -1.0], [-0.3, 0.0, 0.0]])
    valid = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert compute_mult_prob_error(learner, behav, valid) == pytest.approx((math.exp(0.5) + 1 + math.exp(0.2)) / 3)
    assert compute_mult_prob_error(learner, behav, torch.zeros_like(valid)) == 1.0


def test_batch_normalised_is_is_planned_on_the_whole_batch_and_refused_where_nothing_is_a_ratio():
    from asyncrl.algos.config import AlgoConfig
    from asyncrl.algos.offpolicy_plan import PROX_RECOMPUTE, WEIGHT_BATCH, OffPolicyPlan

    plan = OffPolicyPlan.from_algo(AlgoConfig(correction="tis", is_level="sequence", is_batch_norm=True))
    assert plan.weight_source == WEIGHT_BATCH and plan.prox_source == PROX_RECOMPUTE
    assert plan.weight_batch_norm == "sequence"
    assert OffPolicyPlan.from_algo(AlgoConfig(is_batch_norm=True)).weight_batch_norm == "token"  # decoupled
    assert OffPolicyPlan.from_algo(AlgoConfig()).weight_batch_norm is None
    for kwargs in ({"correction": "geo_rs"}, {"correction": "none"}, {"correction": "rs"}):
        with pytest.raises(ValueError, match="is_batch_norm normalises importance weights"):
            AlgoConfig(is_batch_norm=True, **kwargs)
    with pytest.raises(ValueError, match="loglinear"):
        AlgoConfig(is_batch_norm=True, prox_logprobs="loglinear")
