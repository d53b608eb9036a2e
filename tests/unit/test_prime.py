"""PRIME (docs/algorithms.md §1.12): its advantage, implicit rewards, PRM loss and pair accuracy against hand-computed
values; the PRM's training on a tiny model (it learns to tell right completions from wrong ones); the train step
with algo.advantage=prime in each update order; its checkpoint; and the config's refusals."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from asyncrl.algos.advantages import whiten_over_valid_tokens
from asyncrl.algos.config import AlgoConfig
from asyncrl.algos.offpolicy_plan import ADVANTAGE_PRIME, OffPolicyPlan
from asyncrl.algos.prime import (compute_prime_advantages, implicit_process_rewards, last_valid_positions,
                                 leave_one_out, prm_loss, prm_pair_accuracy)
from asyncrl.configs import RunConfig, load_config
from asyncrl.learner.batch import build_batch
from asyncrl.learner.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from asyncrl.learner.config import PRMConfig
from asyncrl.learner.model import build_qwen2, load_model
from asyncrl.learner.prm import ImplicitPRM, outcome_labels, process_rewards, train_prm
from asyncrl.learner.state import LearnerState
from asyncrl.learner.train_step import StepSettings, compute_advantages, compute_batch_logprobs, train_step
from tests.groups import make_group

NAN = float("nan")
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
LOG_RATIO = torch.tensor([[0.2, -0.1, 0.3], [0.1, 0.5, NAN]])  # the masked position holds garbage


def test_leave_one_out_of_token_rewards_and_of_the_outcome_matches_hand_computed_values():
    # row means 0.4/3 and 0.3; n = 2: r -> 2 r - (2/15 + 3/10) = 2 r - 13/30
    got = leave_one_out(LOG_RATIO, MASK, group_size=2)
    expected = torch.tensor([[-1 / 30, -19 / 30, 5 / 30], [-7 / 30, 17 / 30, 0.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # one reward per row on its last token: R_i - mean of the others, RLOO (n = 3: R = 1, 0, 0.5)
    last = torch.tensor([[False, True], [True, False], [False, True]])
    placed = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.5]])
    got = leave_one_out(placed, last, group_size=3)
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.75], [-0.75, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="group_size >= 2"):
        leave_one_out(placed, last, group_size=1)


def test_prime_advantage_sums_both_sources_returns_to_go_and_whitens():
    """One group of two: process_coef 2, outcome_coef 3, R = (1, 0). In thirtieths, the process part is
    2 * [-1, -19, 5] and 2 * [-7, 17]; the outcome's RLOO is +3 on row 0's last token (t = 2), -3 on row 1's (t = 1);
    the returns are the reverse sums."""
    outcome = torch.tensor([1.0, 0.0])
    advantages, returns = compute_prime_advantages(LOG_RATIO, outcome, MASK, group_size=2, process_coef=2.0,
                                                   outcome_coef=3.0)
    expected = torch.tensor([[60.0, 62.0, 100.0], [-70.0, -56.0, 0.0]]) / 30
    torch.testing.assert_close(returns, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(advantages, whiten_over_valid_tokens(expected, MASK.bool()), rtol=0, atol=1e-6)
    assert float(advantages[1, 2]) == 0.0
    # the outcome alone is RLOO (+1, -1) on every token, then whitened
    advantages, returns = compute_prime_advantages(LOG_RATIO, outcome, MASK, group_size=2, process_coef=0.0,
                                                   outcome_coef=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))
    # the outcome goes on the last trained token even with a hole in the mask (a tool's output between turns)
    holed = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert last_valid_positions(holed).tolist() == [[False, False, True, False], [False, True, False, False]]
    _, returns = compute_prime_advantages(torch.zeros(2, 4), outcome, holed, group_size=2, process_coef=0.0)
    torch.testing.assert_close(returns, torch.tensor([[5.0, 0.0, 5.0, 0.0], [-5.0, -5.0, 0.0, 0.0]]))


def test_implicit_rewards_are_beta_times_the_log_ratio_divided_by_the_batchs_largest_return():
    raw = implicit_process_rewards(LOG_RATIO, MASK, beta=0.5, norm="none")
    torch.testing.assert_close(raw, torch.tensor([[0.1, -0.05, 0.15], [0.05, 0.25, 0.0]]))
    # returns-to-go: row 0 (0.2, 0.1, 0.15), row 1 (0.3, 0.25, 0): the largest |return| is 0.3
    normed = implicit_process_rewards(LOG_RATIO, MASK, beta=0.5)
    torch.testing.assert_close(normed, raw / (0.3 + 1e-6))
    with pytest.raises(ValueError, match="norm"):
        implicit_process_rewards(LOG_RATIO, MASK, beta=0.5, norm="group")


def test_prm_loss_is_the_cross_entropy_of_beta_times_the_summed_log_ratio():
    log_ratio = torch.tensor([[1.5, 0.5, NAN], [1.5, 0.5, 7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss = prm_loss(log_ratio, mask, torch.tensor([1.0, 0.0]), beta=0.5)
    # β Σ q = 1: -log σ(1) = log(1 + e^-1) and -log(1 - σ(1)) = log(1 + e)
    torch.testing.assert_close(loss, torch.tensor([math.log1p(math.exp(-1)), math.log1p(math.e)]))
    loss.sum().backward()
    # d/dq_t = β (σ(β Σ q) - label) on trained tokens, 0 elsewhere (the NaN never reaches the gradient)
    sigma = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(log_ratio.grad, torch.tensor([[0.5 * (sigma - 1)] * 2 + [0.0], [0.5 * sigma] * 2 + [0.0]]))
    # a partial reward is a soft label, clipped to [0, 1]
    soft = prm_loss(torch.zeros(2, 1), torch.ones(2, 1), torch.tensor([0.25, 3.0]), beta=1.0)
    torch.testing.assert_close(soft, torch.tensor([math.log(2.0), math.log(2.0)]))


def test_pair_accuracy_weights_each_pair_by_its_outcome_gap():
    # pairs of (1, 0, 0.5) scored (0.3, -0.2, 0.5): (0,1) gap 1 right, (0,2) gap 0.5 wrong, (1,2) gap 0.5 right
    assert prm_pair_accuracy(torch.tensor([0.3, -0.2, 0.5]), torch.tensor([1.0, 0.0, 0.5]), 3) == pytest.approx(0.75)
    # a group whose outcomes are all equal counts 0.5, as does a tied score; the mean over groups
    assert prm_pair_accuracy(torch.zeros(3), torch.tensor([0.0, 1.0, 0.5]), 3) == pytest.approx(0.5)
    scores, labels = torch.tensor([0.3, -0.2, 1.0, 2.0]), torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert prm_pair_accuracy(scores, labels, 2) == pytest.approx(0.75)


@pytest.fixture
def policy_dir(tmp_path):
    model = build_qwen2(vocab_size=32, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0, seed=0)
    path = tmp_path / "policy"
    model.save_pretrained(path)
    return str(path), model.double()


def make_prm(path: str, lr: float = 1e-3, **overrides) -> ImplicitPRM:
    model = load_model(path).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return ImplicitPRM(model, optimizer, scheduler, PRMConfig(**overrides))


def settings_for(version: int = 0, budget: int = 32) -> StepSettings:
    return StepSettings(version=version, max_staleness=4, max_tokens_per_microbatch=budget, chunk_tokens=8,
                        grad_clip=1.0)


def test_the_prm_learns_to_score_right_completions_above_wrong_ones(policy_dir):
    """Trained on a fixed batch, the BCE falls and the PRM's summed log-ratio separates the outcomes; a fresh PRM
    (the reference's weights) gives token rewards of exactly 0."""
    path, policy = policy_dir
    prm = make_prm(path, lr=3e-3, beta=1.0)
    rng = np.random.default_rng(5)
    groups = [make_group(rng, n=4) for _ in range(4)]
    batch = build_batch(groups)
    settings = settings_for(budget=512)
    batch.logprobs_ref = compute_batch_logprobs(policy, batch, settings)
    labels = outcome_labels(batch)
    assert 0 < float(labels.sum()) < batch.num_rows  # both outcomes are in the batch
    rewards, log_ratio = process_rewards(compute_batch_logprobs(prm.model, batch, settings), batch, prm.cfg)
    assert float(rewards.abs().max()) == 0.0 and float(log_ratio.abs().max()) == 0.0  # π_φ = π_ref at the start
    first = train_prm(prm, batch, 4, settings)
    assert first["prm/loss"] == pytest.approx(math.log(2.0))  # σ(0) = 1/2 against every label
    assert first["prm/pair_accuracy"] == pytest.approx(0.5)  # every score ties at 0: no pair is ordered yet
    for _ in range(12):
        last = train_prm(prm, batch, 4, settings)
    # every pair with different outcomes ordered right; a group whose outcomes are all equal counts 0.5
    mixed = [len(set(labels[start:start + 4].tolist())) > 1 for start in range(0, batch.num_rows, 4)]
    assert last["prm/loss"] < 0.1 * first["prm/loss"]
    assert last["prm/pair_accuracy"] == pytest.approx(np.mean([1.0 if m else 0.5 for m in mixed])) and any(mixed)
    _, log_ratio = process_rewards(compute_batch_logprobs(prm.model, batch, settings), batch, prm.cfg)
    summed = (log_ratio * batch.loss_mask).sum(-1)
    assert float(summed[labels == 1].min()) > float(summed[labels == 0].max())


@pytest.mark.parametrize("update", ["before", "after", "none"])
def test_a_prime_step_trains_the_policy_on_the_prms_advantages(policy_dir, update):
    path, policy = policy_dir
    ref = load_model(path).double().eval()
    prm = make_prm(path, update=update)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    groups = [make_group(np.random.default_rng(seed), n=3) for seed in (6, 7, 8)]
    algo = AlgoConfig(advantage="prime")
    before = {name: p.detach().clone() for name, p in prm.model.named_parameters()}
    result = train_step(policy, optimizer, scheduler, groups, algo, settings_for(), ref_model=ref, prm=prm)
    metrics = result.metrics
    assert result.stepped and result.moved and metrics["learner/skipped"] == 0.0
    prm_moved = not all(torch.equal(p, before[name]) for name, p in prm.model.named_parameters())
    assert prm_moved == (update != "none")
    assert ("prm/loss" in metrics) == (update != "none")
    assert math.isfinite(metrics["prm/token_reward/abs_mean"])
    # before: the rewards come from the PRM that has trained on this batch (non-zero); after/none: from π_ref's copy
    assert (metrics["prm/token_reward/abs_mean"] > 0) == (update == "before")


def test_the_steps_prime_advantages_come_from_the_prm_and_the_outcome(policy_dir):
    path, policy = policy_dir
    groups = [make_group(np.random.default_rng(9), n=3)]
    batch = build_batch(groups)
    batch.process_rewards = torch.randn(batch.loss_mask.shape, dtype=torch.float64) * batch.loss_mask
    algo = AlgoConfig(advantage="prime")
    plan = OffPolicyPlan.from_algo(algo)
    assert plan.advantage_path == ADVANTAGE_PRIME
    cfg = PRMConfig(process_coef=2.0, outcome_coef=0.5)
    got, targets = compute_advantages(batch, groups, batch.token_rewards, algo, plan, cfg)
    expected, _ = compute_prime_advantages(batch.process_rewards, outcome_labels(batch).double(), batch.loss_mask, 3,
                                           process_coef=2.0, outcome_coef=0.5)
    torch.testing.assert_close(got, expected.float())
    assert targets is None


def test_checkpoint_keeps_the_prm_and_refuses_a_prime_job_without_one(policy_dir, tmp_path):
    path, policy = policy_dir
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    prm = make_prm(path)
    batch = build_batch([make_group(np.random.default_rng(10), n=2) for _ in range(2)])
    batch.logprobs_ref = compute_batch_logprobs(policy, batch, settings_for())
    train_prm(prm, batch, 2, settings_for())
    saved = save_checkpoint(str(tmp_path / "ckpt"), policy, optimizer, scheduler, LearnerState(version=1),
                            keep_last=0, prm=prm)
    fresh = make_prm(path)
    load_checkpoint(saved, policy, optimizer, scheduler, prm=fresh)
    for (name, expected), got in zip(prm.model.state_dict().items(), fresh.model.state_dict().values()):
        torch.testing.assert_close(got, expected, msg=name)
    moments = [state["exp_avg"] for state in prm.optimizer.state.values()]
    assert moments and all(torch.equal(a, b["exp_avg"]) for a, b in zip(moments, fresh.optimizer.state.values()))
    plain = save_checkpoint(str(tmp_path / "plain"), policy, optimizer, scheduler, LearnerState(version=1),
                            keep_last=0)
    with pytest.raises(CheckpointError, match="holds no prm"):
        load_checkpoint(plain, policy, optimizer, scheduler, prm=make_prm(path))
    load_checkpoint(saved, policy, optimizer, scheduler)  # a job without a PRM ignores the checkpoint's


def test_config_builds_a_prm_and_its_reference_only_for_prime():
    algo = AlgoConfig(advantage="prime")
    assert algo.needs_prm() and algo.needs_reference_model() and not algo.needs_critic()
    assert not AlgoConfig().needs_prm() and not AlgoConfig().needs_reference_model()
    cfg = load_config("prime.yaml", [])
    assert cfg.algo.advantage == "prime" and cfg.prm.beta == 0.05 and cfg.rollout.n >= 2
    with pytest.raises(Exception, match="prm section is set"):
        load_config(None, ["prm.beta=0.1"])
    with pytest.raises(Exception, match="rollout.n must be >= 2"):
        load_config(None, ["algo.advantage=prime", "rollout.n=1", "algo.dynamic_sampling=false"])
    with pytest.raises(ValueError, match="kl_loss_coef"):
        AlgoConfig(advantage="prime", kl_reward_coef=0.01)
    assert AlgoConfig(advantage="prime", kl_loss_coef=0.01).needs_reference_model()
    with pytest.raises(ValueError, match="both 0"):
        PRMConfig(process_coef=0.0, outcome_coef=0.0)
    with pytest.raises(ValueError, match="prm.update"):
        PRMConfig(update="sometimes")
    assert dataclasses.asdict(RunConfig().prm) == dataclasses.asdict(PRMConfig())
