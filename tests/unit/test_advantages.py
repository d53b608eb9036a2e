"""Golden fp64 tests for asyncrl.algos.advantages (docs/algorithms.md §1.2-1.14, §5 T3, T15).

Expected numbers are computed by hand in the comments; whitening is re-derived with the stdlib `statistics`
module (sample variance, N - 1), independently of the code under test.
"""
import math
import statistics

import pytest
import torch

from asyncrl.algos.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    bradley_terry_win_rates,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_token_advantages,
)

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def outcome_batch(rewards, lengths, T=4, garbage=0.0):
    """Rows with `lengths` valid tokens (a prefix), reward on the last valid token, `garbage` off-mask."""
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(F64)  # [B, T]
    token_rewards = torch.full(mask.shape, garbage, dtype=F64)
    token_rewards[mask.bool()] = 0.0
    for row, (r, n) in enumerate(zip(rewards, lengths)):
        if n > 0:
            token_rewards[row, n - 1] = r
    return token_rewards, mask


def whiten(xs):
    mean, std = statistics.mean(xs), math.sqrt(statistics.variance(xs) + 1e-8)
    return [(x - mean) / std for x in xs]


def valid_values(adv, mask):
    return adv[mask.bool()].tolist()


# T3 -------------------------------------------------------------------------------------------------------
def test_grpo_token_advantages_broadcast_the_verl_group_normalised_reward():
    token_rewards, mask = outcome_batch([1, 0, 0, 1, 2, 2, 2, 2], [1, 2, 3, 4, 2, 2, 1, 3])
    adv = compute_token_advantages("grpo", AdvantageInputs(token_rewards, mask, group_size=4))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # mean .5, unbiased std .57735
    assert a == pytest.approx(0.86603, abs=1e-5)
    want = torch.tensor([a, -a, -a, a, 0, 0, 0, 0], dtype=F64)[:, None] * mask
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-15)
    assert torch.equal(adv[4:], torch.zeros(4, 4, dtype=F64))  # all-equal group: exactly 0, finite


def test_dr_grpo_drops_the_std():
    token_rewards, mask = outcome_batch([1, 0, 0, 1], [1, 2, 3, 4])
    adv = compute_token_advantages("grpo", AdvantageInputs(token_rewards, mask, 4), norm_by_std=False)
    assert torch.equal(adv, torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=F64)[:, None] * mask)


def test_grpo_eps_is_added_to_the_std():
    token_rewards, mask = outcome_batch([1, 0], [1, 1], T=1)
    adv = compute_token_advantages("grpo", AdvantageInputs(token_rewards, mask, 2), eps=0.1)
    std = math.sqrt(0.5)
    assert adv[:, 0].tolist() == pytest.approx([0.5 / (std + 0.1), -0.5 / (std + 0.1)], abs=1e-15)


def test_grpo_singleton_group_keeps_the_raw_reward():
    token_rewards, mask = outcome_batch([3.0, -1.0], [2, 1])
    assert torch.equal(compute_token_advantages("grpo", AdvantageInputs(token_rewards, mask, 1)),
                       torch.tensor([3.0, -1.0], dtype=F64)[:, None] * mask)
    assert torch.equal(compute_grpo_advantages(torch.tensor([[3.0], [-1.0]], dtype=F64)),
                       torch.tensor([[3.0], [-1.0]], dtype=F64))


def test_rloo_is_leave_one_out_and_sums_to_zero_per_group():
    token_rewards, mask = outcome_batch([1, 0, 0, 1, 3, 1, 2, 6], [1, 2, 3, 4, 1, 1, 1, 1])
    adv = compute_token_advantages("rloo", AdvantageInputs(token_rewards, mask, 4))
    # group 1: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3; group 2: 3 - 9/3 = 0, 1 - 11/3 = -8/3, 2 - 10/3 = -4/3, 6 - 2 = 4
    want = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, -8 / 3, -4 / 3, 4], dtype=F64)[:, None] * mask
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-14)
    per_completion = adv[:, 0].view(2, 4)  # every row is valid at t = 0
    torch.testing.assert_close(per_completion.sum(1), torch.zeros(2, dtype=F64), rtol=0, atol=1e-14)


def test_sppo_target_is_the_reward_less_the_groups_soft_mean():
    """s_i = R_i - SM_η(R_group), SM_η = (1/η) log mean exp(η R), per prompt (verl takes it over the batch): R = [1, 0]
    gives [1 - ln((e+1)/2), -ln((e+1)/2)] = [0.3798855, -0.6201145]; η scales the soft-mean towards the max (large η)
    or the mean (small η); equal rewards give 0; the loss's η is the default."""
    token_rewards, mask = outcome_batch([1, 0, 0.5, 0.5], [2, 3, 1, 4])
    adv = compute_token_advantages("sppo", AdvantageInputs(token_rewards, mask, 2))
    soft = math.log((math.e + 1) / 2)
    want = torch.tensor([1 - soft, -soft, 0.0, 0.0], dtype=F64)[:, None] * mask
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-12)
    assert valid_values(adv, mask)[0] == pytest.approx(0.3798855, abs=1e-7)
    tiny = compute_token_advantages("sppo", AdvantageInputs(token_rewards, mask, 2), eta=1e-6)
    torch.testing.assert_close(tiny[:2, 0], torch.tensor([0.5, -0.5], dtype=F64), rtol=0, atol=1e-6)  # the mean
    large = compute_token_advantages("sppo", AdvantageInputs(token_rewards, mask, 2), eta=50.0)
    assert float(large[0, 0]) == pytest.approx(math.log(2) / 50, abs=1e-9)  # SM_50 ≈ max - ln(2)/50
    with pytest.raises(ValueError, match="does not read it"):
        compute_token_advantages("grpo", AdvantageInputs(token_rewards, mask, 2), eta=1.0)


def test_sppo_bradley_terry_target_is_each_samples_win_rate_against_its_group_less_a_half():
    """A reward model's scores as Bradley–Terry preferences, P(y_i ≻ y_j) = σ(r_i - r_j), P̂_i their mean over the
    whole group (i itself at ½), s_i = P̂_i - ½. By hand: scores [1, 0] give P̂ = [(½ + σ(1)) / 2, (σ(-1) + ½) / 2] =
    [0.6155293, 0.3844707]; scores [2, 0, 0] give P̂_0 = (½ + 2 σ(2)) / 3 = 0.7538647 and P̂_1 = P̂_2 = (σ(-2) + 1) / 3
    = 0.3730676. Only differences count (an offset of 100 changes nothing), η does not scale the target (the loss
    multiplies it), and scores far apart saturate at a win rate without NaN."""
    token_rewards, mask = outcome_batch([1, 0, 0, 0], [2, 3, 1, 4])
    adv = compute_token_advantages("sppo", AdvantageInputs(token_rewards, mask, 2), sppo_target="bradley_terry")
    assert valid_values(adv, mask)[:3] == pytest.approx([0.1155293, 0.1155293, -0.1155293], abs=1e-7)
    assert adv[2:].abs().max() == 0  # equal scores: every win rate is ½
    assert (adv[~mask.bool()] == 0).all()
    three, three_mask = outcome_batch([102, 100, 100], [1, 1, 1])
    wins = compute_token_advantages("sppo", AdvantageInputs(three, three_mask, 3), eta=7.0,
                                    sppo_target="bradley_terry")[:, 0] + 0.5
    assert wins.tolist() == pytest.approx([0.7538647, 0.3730676, 0.3730676], abs=1e-7)
    assert float(wins.sum()) == pytest.approx(1.5, abs=1e-12)  # the group's mean win rate is exactly ½
    torch.testing.assert_close(bradley_terry_win_rates(torch.tensor([[1e30, -1e30]], dtype=F64)),
                               torch.tensor([[0.75, 0.25]], dtype=F64), rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not read it"):
        compute_token_advantages("grpo", AdvantageInputs(token_rewards, mask, 2), sppo_target="bradley_terry")
    with pytest.raises(ValueError, match="unknown sppo target"):
        compute_token_advantages("sppo", AdvantageInputs(token_rewards, mask, 2), sppo_target="elo")


def test_grpo_passk_trains_only_each_groups_best_completion():
    token_rewards, mask = outcome_batch([0.2, 1.0, 0.5, 0.0, 3, 3, 1, 0], [1, 2, 3, 4, 1, 2, 1, 1])
    plain = compute_token_advantages("grpo_passk", AdvantageInputs(token_rewards, mask, 4), norm_by_std=False)
    # group 1: best 1.0, second 0.5: +0.5 on row 1 only; group 2: a tie at 3 gives the first best 3 - 3 = 0
    want = torch.tensor([0, 0.5, 0, 0, 0, 0, 0, 0], dtype=F64)[:, None] * mask
    torch.testing.assert_close(plain, want, rtol=0, atol=1e-15)
    normed = compute_token_advantages("grpo_passk", AdvantageInputs(token_rewards, mask, 4))
    std = statistics.stdev([0.2, 1.0, 0.5, 0.0])
    assert normed[1, :2].tolist() == pytest.approx([0.5 / (std + 1e-6)] * 2, abs=1e-12)
    assert normed[[0, 2, 3, 4, 5, 6, 7]].abs().max() == 0
    with pytest.raises(ValueError, match="grpo_passk needs group_size >= 2"):
        compute_token_advantages("grpo_passk", AdvantageInputs(token_rewards, mask, 1))


def test_rloo_rejects_singleton_groups():
    token_rewards, mask = outcome_batch([1, 0], [1, 1])
    with pytest.raises(ValueError, match="rloo needs group_size >= 2"):
        compute_token_advantages("rloo", AdvantageInputs(token_rewards, mask, 1))


# REINFORCE++ ------------------------------------------------------------------------------------------------
def test_reinforce_pp_whitens_returns_to_go_over_the_global_batch():
    token_rewards = torch.tensor([[-0.1, 1.0, NAN], [0.0, 0.0, 2.0]], dtype=F64)  # a KL penalty on row 0, t=0
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
    adv = compute_token_advantages("reinforce_pp", AdvantageInputs(token_rewards, mask, 1))
    # returns-to-go (γ = 1): row 0 [0.9, 1.0], row 1 [2, 2, 2]; mean 1.58, unbiased var 1.328 / 4 = 0.332
    returns = [0.9, 1.0, 2.0, 2.0, 2.0]
    want = [d / math.sqrt(0.332 + 1e-8) for d in (-0.68, -0.58, 0.42, 0.42, 0.42)]
    assert valid_values(adv, mask) == pytest.approx(want, abs=1e-12)
    assert valid_values(adv, mask) == pytest.approx(whiten(returns), abs=1e-12)
    assert adv[0, 2].item() == 0.0


def test_reinforce_pp_discounts_per_valid_token_and_skips_mask_holes():
    # row 0: contiguous, G = [0.25, 0.5, 1]; row 1: a masked hole at t=1 is not a discount step, G = [1, -, 2]
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, INF, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=F64)
    adv = compute_token_advantages("reinforce_pp", AdvantageInputs(token_rewards, mask, 2), gamma=0.5)
    assert valid_values(adv, mask) == pytest.approx(whiten([0.25, 0.5, 1.0, 1.0, 2.0]), abs=1e-12)
    assert adv[1, 1].item() == 0.0


def test_reinforce_pp_gamma_one_is_the_plain_reverse_cumsum():
    token_rewards = torch.tensor([[0.3, -0.2, 1.0, 0.0], [0.1, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=F64)
    adv = compute_token_advantages("reinforce_pp", AdvantageInputs(token_rewards, mask, 1))
    assert valid_values(adv, mask) == pytest.approx(whiten([1.1, 0.8, 1.0, 0.1]), abs=1e-12)


def test_reinforce_pp_baseline_centres_per_group_then_whitens_per_token():
    token_rewards, mask = outcome_batch([1, 0, 3, 3], [1, 2, 1, 1])
    adv = compute_token_advantages("reinforce_pp_baseline", AdvantageInputs(token_rewards, mask, 2))
    # centred [0.5, -0.5, 0, 0] on tokens [0.5 | -0.5, -0.5 | 0 | 0]: mean -0.1, unbiased var 0.70 / 4 = 0.175
    want = [d / math.sqrt(0.175 + 1e-8) for d in (0.6, -0.4, -0.4, 0.1, 0.1)]
    assert valid_values(adv, mask) == pytest.approx(want, abs=1e-12)


# OPO, GPG, ReMax ------------------------------------------------------------------------------------------
def test_opo_baseline_is_the_length_weighted_group_mean():
    token_rewards, mask = outcome_batch([1, 0, 0, 2], [1, 3, 2, 2])
    adv = compute_token_advantages("opo", AdvantageInputs(token_rewards, mask, 2))
    # group 1: b = (1*1 + 3*0) / 4 = 0.25 (GRPO's mean would be 0.5); group 2: b = (2*0 + 2*2) / 4 = 1
    want = torch.tensor([0.75, -0.25, -1.0, 1.0], dtype=F64)[:, None] * mask
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-15)


def test_opo_singleton_group_has_no_baseline():
    token_rewards, mask = outcome_batch([2.0, -1.0], [3, 1])
    adv = compute_token_advantages("opo", AdvantageInputs(token_rewards, mask, 1))
    assert torch.equal(adv, torch.tensor([2.0, -1.0], dtype=F64)[:, None] * mask)


@pytest.mark.parametrize("rewards, want", [
    ([1, 0, 0, 0], [2, -2, 0, 0]),  # α = 4 / 1: one non-zero reward in the batch of 4
    ([1, 0, 1, 1], [2 / 3, -2 / 3, 0, 0]),  # α = 4 / 3
    ([0, 0, 0, 0], [0, 0, 0, 0]),  # α = 4 / max(1, 0), finite
    ([2, -1, 0, 0], [3, -3, 0, 0]),  # α = 4 / 2 (negative rewards count as non-zero) times ±1.5
])
def test_gpg_scales_the_centred_reward_by_batch_over_nonzero_count(rewards, want):
    token_rewards, mask = outcome_batch(rewards, [1, 2, 3, 4])
    adv = compute_token_advantages("gpg", AdvantageInputs(token_rewards, mask, 2))
    torch.testing.assert_close(adv, torch.tensor(want, dtype=F64)[:, None] * mask, rtol=0, atol=1e-14)


def test_remax_subtracts_the_greedy_reward_of_the_prompt_from_the_return_to_go():
    token_rewards = torch.tensor([[-0.1, -0.2, 1.0], [0.0, 3.0, NAN], [0.0, 0.0, 1.0], [2.0, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=F64)
    inputs = AdvantageInputs(token_rewards, mask, 2, baseline_rewards=torch.tensor([0.5, 2.0], dtype=F64))
    adv = compute_token_advantages("remax", inputs)
    # returns [0.7, 0.8, 1.0], [3, 3], [1, 1, 1], [2]; baselines 0.5 (rows 0, 1) and 2.0 (rows 2, 3)
    want = torch.tensor([[0.2, 0.3, 0.5], [2.5, 2.5, 0], [-1, -1, -1], [0, 0, 0]], dtype=F64)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-14)


def test_remax_requires_the_greedy_baseline():
    token_rewards, mask = outcome_batch([1, 0], [1, 1])
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_token_advantages("remax", AdvantageInputs(token_rewards, mask, 2))


# Registry and contract ------------------------------------------------------------------------------------
def test_registry_holds_exactly_the_published_estimators():
    assert isinstance(ADVANTAGES, dict)
    assert set(ADVANTAGES) == {"grpo", "grpo_passk", "rloo", "reinforce_pp", "reinforce_pp_baseline", "opo", "gpg",
                               "remax", "sppo"}


def nasty_inputs():
    """Garbage off-mask, an all-masked row, a zero-variance group, a NaN-free greedy baseline."""
    token_rewards, mask = outcome_batch([1, 0, 1, 1, 5, 0], [3, 0, 2, 4, 1, 2], garbage=NAN)
    token_rewards[0, 3] = INF
    token_rewards[1, :] = -INF  # the all-masked row
    return AdvantageInputs(token_rewards.requires_grad_(), mask, 2, baseline_rewards=torch.ones(3, dtype=F64))


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_every_estimator_is_finite_zero_off_mask_and_detached(name):
    inputs = nasty_inputs()
    adv = compute_token_advantages(name, inputs)
    assert adv.shape == inputs.loss_mask.shape and adv.dtype == F64
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[~inputs.loss_mask.bool()], torch.zeros_like(adv[~inputs.loss_mask.bool()]))
    assert not adv.requires_grad


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg"])
def test_outcome_estimators_give_one_value_per_completion(name):
    inputs = nasty_inputs()
    adv = compute_token_advantages(name, inputs)
    for row, valid in enumerate(inputs.loss_mask.bool()):
        values = adv[row][valid]
        assert torch.equal(values, values[:1].expand_as(values))


def test_inconsistent_inputs_are_rejected_with_a_reason():
    token_rewards, mask = outcome_batch([1, 0, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="does not split into groups"):
        AdvantageInputs(token_rewards, mask, 2)
    with pytest.raises(ValueError, match=r"must both be \[B, T\]"):
        AdvantageInputs(token_rewards, mask[:, :2], 1)
    with pytest.raises(ValueError, match="baseline_rewards must be"):
        AdvantageInputs(token_rewards, mask, 3, baseline_rewards=torch.zeros(3))
    inputs = AdvantageInputs(token_rewards, mask, 3)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_token_advantages("ppo", inputs)
    with pytest.raises(ValueError, match="has no effect"):
        compute_token_advantages("grpo", inputs, gamma=0.99)
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_token_advantages("reinforce_pp", inputs, gamma=0.0)


# GAE (no critic in the learner yet) -----------------------------------------------------------------------
def test_gae_matches_a_hand_computed_trajectory():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    adv, returns = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # δ2 = 1 - 0.7 = 0.3; δ1 = 0.9*0.7 - 0.6 = 0.03; δ0 = 0.9*0.6 - 0.5 = 0.04; γλ = 0.72
    # Â2 = 0.3, Â1 = 0.03 + 0.72*0.3 = 0.246, Â0 = 0.04 + 0.72*0.246 = 0.21712
    assert adv[0].tolist() == pytest.approx([0.21712, 0.246, 0.3], abs=1e-14)
    assert returns[0].tolist() == pytest.approx([0.71712, 0.846, 1.0], abs=1e-14)
    whitened, same_returns = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert whitened[0].tolist() == pytest.approx(whiten([0.21712, 0.246, 0.3]), abs=1e-12)
    assert torch.equal(same_returns, returns)  # returns are taken before whitening


def test_gae_skips_masked_positions_and_ignores_their_garbage():
    rewards = torch.tensor([[0.0, NAN, 1.0, NAN]], dtype=F64)
    values = torch.tensor([[0.5, NAN, 0.7, INF]], dtype=F64)
    mask = torch.tensor([[1, 0, 1, 0]], dtype=F64)
    adv, returns = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # Â2 = 1 - 0.7 = 0.3; t=1 carried over; δ0 = 0.9*0.7 - 0.5 = 0.13, Â0 = 0.13 + 0.72*0.3 = 0.346
    assert adv[0].tolist() == pytest.approx([0.346, 0.0, 0.3, 0.0], abs=1e-14)
    assert returns[0].tolist() == pytest.approx([0.846, 0.0, 1.0, 0.0], abs=1e-14)


def test_gae_with_zero_critic_and_unit_gamma_lambda_is_the_return_to_go():
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, returns = compute_gae_advantages(rewards, torch.zeros_like(rewards), mask, whiten=False)
    want = torch.tensor([[0.9, 0.8, 1.0], [2.0, 2.0, 0.0]], dtype=F64)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-15)
    torch.testing.assert_close(returns, want, rtol=0, atol=1e-15)


def test_the_learners_sppo_step_reads_the_groups_rewards_as_the_config_says():
    """train_step's advantages for algo.sppo_target=bradley_terry are each sample's win rate from its group's rewards
    (a reward model's scores here) less ½, and for softmean R - SM_η(R): the config reaches the estimator."""
    import numpy as np

    from asyncrl.algos.config import AlgoConfig
    from asyncrl.algos.offpolicy_plan import OffPolicyPlan
    from asyncrl.learner.batch import build_batch
    from asyncrl.learner.train_step import compute_advantages
    from tests.groups import make_group

    groups = [make_group(np.random.default_rng(seed), n=3) for seed in (1, 2)]
    scores = [[2.5, -1.0, 0.25], [0.0, 3.0, 3.0]]
    for group, row in zip(groups, scores):
        for sample, score in zip(group.samples, row):
            sample.reward = score
    batch = build_batch(groups)
    mask = batch.loss_mask.bool()
    for target, eta in (("bradley_terry", 2.0), ("softmean", 2.0)):
        algo = AlgoConfig(advantage="sppo", loss="sppo", correction="bypass", loss_agg="seq-mean-token-mean",
                          sppo_eta=eta, sppo_target=target)
        advantages, _ = compute_advantages(batch, groups, batch.token_rewards, algo, OffPolicyPlan.from_algo(algo))
        r = torch.tensor(scores, dtype=F64)
        want = (bradley_terry_win_rates(r) - 0.5 if target == "bradley_terry"
                else r - (torch.logsumexp(eta * r, 1, keepdim=True) - math.log(3)) / eta).flatten()
        per_row = [advantages[row][mask[row]] for row in range(6)]
        for row, values in enumerate(per_row):
            torch.testing.assert_close(values, torch.full_like(values, float(want[row])), rtol=0, atol=1e-6)
