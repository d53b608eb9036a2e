"""The off-policy plan (algos/offpolicy_plan.py): for every correction and a few losses it gives the answers the learner used
to derive from the names (π_prox source, centre of the loss ratio, weight and where it is computed, V-trace)."""
import pytest

from asyncrl.algos.config import CORRECTION_NAMES, AlgoConfig
from asyncrl.algos.offpolicy_plan import (
    ADVANTAGE_ESTIMATOR,
    ADVANTAGE_GAE,
    ADVANTAGE_VTRACE,
    CENTRE_BEHAV,
    CENTRE_PROX,
    PROX_FUSED,
    PROX_LOGLINEAR,
    PROX_RECOMPUTE,
    WEIGHT_BATCH,
    WEIGHT_CURRENT,
    WEIGHT_NONE,
    WEIGHT_PER_MICRO,
    OffPolicyPlan,
)
from asyncrl.learner.objective import resolved_hyperparameters

ROW_WISE = ("decoupled", "tis", "mis", "geo_rs", "k3_rs", "icepop")


def plan(**kwargs) -> OffPolicyPlan:
    return OffPolicyPlan.from_algo(AlgoConfig(**kwargs))


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "reinforce"])
@pytest.mark.parametrize("correction", ROW_WISE)
def test_row_wise_corrections_weight_each_micro_batch_from_the_fused_prox(loss, correction):
    p = plan(loss=loss, correction=correction)
    assert (p.prox_source, p.centre, p.weight_source) == (PROX_FUSED, CENTRE_PROX, WEIGHT_PER_MICRO)
    assert p.weight_correction == correction and p.batch_metrics_correction == correction
    assert not p.vtrace_advantages


def test_decoupled_ppo_passes_the_configured_hyperparameters():
    p = plan(loss="ppo", correction="decoupled", clip_high=0.3, is_cap=3.0, is_mode="mask")
    assert p.loss == "ppo" and p.loss_kwargs == {"clip_high": 0.3}
    assert p.weight_kwargs == {"cap": 3.0, "mode": "mask"}


@pytest.mark.parametrize("loss", ["ppo", "sapo", "topr", "reinforce"])
def test_no_correction_has_no_weight(loss):
    p = plan(loss=loss, correction="none")
    assert (p.prox_source, p.centre, p.weight_source, p.weight_correction) == (PROX_FUSED, CENTRE_PROX, WEIGHT_NONE,
                                                                              None)
    assert p.batch_metrics_correction is None


def test_m2po_recomputes_prox_and_weights_the_whole_batch_once():
    p = plan(loss="ppo", correction="m2po", m2_threshold=0.1)
    assert (p.prox_source, p.centre, p.weight_source) == (PROX_RECOMPUTE, CENTRE_PROX, WEIGHT_BATCH)
    assert p.weight_correction == "m2po" and p.weight_kwargs == {"threshold": 0.1}
    assert p.batch_metrics_correction == "m2po"


def test_vtrace_recomputes_prox_and_puts_its_weights_in_the_advantages():
    p = plan(loss="reinforce", correction="vtrace", vtrace_clip_rho=2.0)
    assert (p.prox_source, p.centre, p.weight_source) == (PROX_RECOMPUTE, CENTRE_PROX, WEIGHT_NONE)
    assert p.vtrace_advantages and p.vtrace_kwargs == {"clip_rho": 2.0}
    assert p.batch_metrics_correction is None


@pytest.mark.parametrize("loss", ["reinforce", "gpg"])
def test_bypass_with_plain_policy_gradient_weights_the_current_pass_by_tis(loss):
    p = plan(loss=loss, correction="bypass")
    assert (p.prox_source, p.centre, p.weight_source) == (PROX_FUSED, CENTRE_BEHAV, WEIGHT_CURRENT)
    assert p.weight_correction == "tis" and p.weight_kwargs == {"cap": 2.0}
    assert plan(loss=loss, correction="bypass", is_cap=4.0).weight_kwargs == {"cap": 4.0}
    assert p.batch_metrics_correction is None


@pytest.mark.parametrize("loss", ["ppo", "gspo", "sapo", "topr"])
def test_bypass_with_a_ratio_or_topr_centres_on_the_behaviour_policy_without_weight(loss):
    p = plan(loss=loss, correction="bypass")
    assert (p.prox_source, p.centre, p.weight_source) == (PROX_FUSED, CENTRE_BEHAV, WEIGHT_NONE)


@pytest.mark.parametrize("correction", [c for c in CORRECTION_NAMES if c != "vtrace"])
def test_two_minibatches_need_the_recomputed_prox(correction):
    assert plan(correction=correction, ppo_minibatches=2).prox_source == PROX_RECOMPUTE


@pytest.mark.parametrize("correction", ["none", "decoupled", "tis", "icepop"])
def test_loglinear_prox_is_a3po(correction):
    p = plan(correction=correction, prox_logprobs="loglinear")
    assert p.prox_source == PROX_LOGLINEAR and p.centre == CENTRE_PROX


def test_the_plan_is_frozen():
    with pytest.raises(AttributeError):
        plan().prox_source = PROX_RECOMPUTE


def test_resolved_hyperparameters_show_the_bypass_cap_of_plain_policy_gradient():
    assert resolved_hyperparameters(AlgoConfig(loss="reinforce", correction="bypass")) == {
        "algo.resolved.bypass.cap": "2.0"}
    assert resolved_hyperparameters(AlgoConfig(loss="ppo", correction="bypass"))["algo.resolved.ppo.clip_low"] == "0.2"
    assert not any(key.startswith("algo.resolved.bypass") for key in
                   resolved_hyperparameters(AlgoConfig(loss="ppo", correction="bypass")))


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "opo"])
def test_group_estimators_read_the_rewards_alone(advantage):
    p = plan(advantage=advantage)
    assert (p.advantage_path, p.estimator) == (ADVANTAGE_ESTIMATOR, advantage)
    assert not p.critic_values and not p.greedy_baseline and p.vtrace_baseline == "none"


def test_remax_is_an_estimator_with_the_greedy_baseline():
    p = plan(advantage="remax")
    assert (p.advantage_path, p.estimator, p.greedy_baseline, p.critic_values) == (
        ADVANTAGE_ESTIMATOR, "remax", True, False)


def test_gae_reads_the_critic():
    p = plan(advantage="gae", lam=0.95)
    assert (p.advantage_path, p.critic_values, p.greedy_baseline) == (ADVANTAGE_GAE, True, False)


@pytest.mark.parametrize("values, critic", [("none", False), ("group_mean", False), ("critic", True)])
def test_vtrace_replaces_the_estimator_and_names_its_baseline(values, critic):
    p = plan(loss="reinforce", correction="vtrace", vtrace_values=values)
    assert (p.advantage_path, p.vtrace_baseline, p.critic_values) == (ADVANTAGE_VTRACE, values, critic)
