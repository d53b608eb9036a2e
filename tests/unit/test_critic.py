"""PPO's critic: the clipped value loss and explained variance against hand-computed values, V-trace's targets, the
value model's loading and alignment, the train step with GAE (warmup included), its checkpoint, and the config's
refusals."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from asyncrl.algos.advantages import compute_gae_advantages
from asyncrl.algos.config import AlgoConfig
from asyncrl.algos.value_loss import compute_value_loss, explained_variance
from asyncrl.algos.vtrace import compute_vtrace_advantages, compute_vtrace_advantages_and_targets
from asyncrl.configs import RunConfig, load_config
from asyncrl.learner.batch import build_batch
from asyncrl.learner.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from asyncrl.learner.config import CriticConfig
from asyncrl.learner.critic import Critic, compute_values, load_value_model
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.state import LearnerState
from asyncrl.learner.train_step import StepSettings, train_step
from tests.groups import make_group


def test_clipped_value_loss_matches_hand_computed_values():
    old = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0, 9.0]])
    vpreds = torch.tensor([[0.3, 2.0, 1.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    per_token, clipped = compute_value_loss(vpreds, old, returns, mask, cliprange=0.5)
    # token 0: V=0.3 within 0.5 of 0: (0.3-1)^2 both ways -> 0.245
    # token 1: V=2 clipped to 1.5: max((2-1)^2, (1.5-1)^2) = 1 -> 0.5, the unclipped one is larger: not clipped
    # token 2: V=1 clipped to 1.5: max((1-0)^2, (1.5-0)^2) = 2.25 -> 1.125, the clipped one: clipped
    torch.testing.assert_close(per_token, torch.tensor([[0.245, 0.5, 1.125, 0.0]]))
    assert clipped.tolist() == [[False, False, True, False]]
    per_token.sum().backward()
    # d/dV of 0.5 (V - R)^2 = V - R where the unclipped branch wins; 0 where the clipped (constant in V) one does
    torch.testing.assert_close(vpreds.grad, torch.tensor([[-0.7, 1.0, 0.0, 0.0]]))


def test_clipped_value_loss_ignores_garbage_off_mask_and_needs_a_positive_clip():
    nan = float("nan")
    per_token, clipped = compute_value_loss(torch.tensor([[1.0, nan]]), torch.tensor([[1.0, math.inf]]),
                                            torch.tensor([[3.0, nan]]), torch.tensor([[1.0, 0.0]]), cliprange=0.2)
    # V = old = 1, R = 3: clipped V at most 1.2, (1.2-3)^2 = 3.24 > (1-3)^2 = 4? no: 4 > 3.24, unclipped wins
    assert per_token.tolist() == [[2.0, 0.0]] and clipped.tolist() == [[False, False]]
    with pytest.raises(ValueError, match="cliprange"):
        compute_value_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cliprange=0)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0, abs=1e-5)
    # a constant prediction at the mean explains nothing: Var(R - 2) = Var(R)
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0, abs=1e-5)
    # V = [0, 0, 0]: Var(R - V) = Var(R) = 1 -> 0; V = R + [1, -1, 0]: Var = 1 -> 1 - 1/1 = 0
    off = returns + torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    assert explained_variance(off, returns, mask) == pytest.approx(1 - 1 / (1 + 1e-5), abs=1e-6)
    assert math.isnan(explained_variance(returns, returns, torch.tensor([[1.0, 0.0, 0.0, 0.0]])))


def test_vtrace_targets_on_policy_are_the_return_and_advantages_are_unchanged():
    """On-policy with γ = 1, c̄ = ρ̄ = 1: v_s = V_s + Σ_t δ_t telescopes to R on every valid token, whatever V."""
    logprobs = torch.tensor([[-1.0, -0.5, 0.0, -2.0], [-0.3, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.2, 7.0, -0.4, 0.9], [0.5, 3.0, 3.0, 3.0]])
    rewards = torch.tensor([1.0, -2.0])
    advantages, targets = compute_vtrace_advantages_and_targets(logprobs, logprobs, mask, rewards, values)
    expected_targets = torch.tensor([[1.0, 0.0, 1.0, 1.0], [-2.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(targets, expected_targets)
    torch.testing.assert_close(advantages, compute_vtrace_advantages(logprobs, logprobs, mask, rewards, values))
    torch.testing.assert_close(advantages, (rewards[:, None] - values) * mask)  # A_t = R - V_t on-policy


@pytest.fixture
def policy_dir(tmp_path):
    model = build_qwen2(vocab_size=32, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0, seed=0)
    path = tmp_path / "policy"
    model.save_pretrained(path)
    return str(path), model


def test_value_model_from_a_policy_copies_the_body_and_zeroes_the_head(policy_dir, tmp_path):
    path, policy = policy_dir
    critic = load_value_model(path)
    assert torch.equal(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert torch.equal(critic.model.layers[1].mlp.up_proj.weight, policy.model.layers[1].mlp.up_proj.weight)
    assert not critic.score.weight.any() and not critic.score.bias.any()
    ids = torch.randint(2, 32, (2, 6))
    assert float(compute_values(critic, ids, torch.ones_like(ids)).abs().sum()) == 0.0
    with torch.no_grad():  # a critic's own directory keeps its head
        critic.score.weight.fill_(0.25)
    critic.save_pretrained(tmp_path / "critic")
    again = load_value_model(str(tmp_path / "critic"))
    assert torch.equal(again.score.weight, critic.score.weight)
    assert not any(isinstance(module, torch.nn.Dropout) and module.p > 0 for module in again.modules())


def test_values_align_with_logprob_positions_padded_and_packed(policy_dir):
    critic = load_value_model(policy_dir[0]).double()
    torch.nn.init.normal_(critic.score.weight)
    ids = torch.randint(2, 32, (3, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    expected = critic(input_ids=ids, attention_mask=mask).logits[..., 0][:, :-1]  # V at position t, t < L-1
    padded = compute_values(critic, ids, mask)
    packed = compute_values(critic, ids, mask, packed=True)
    valid = mask[:, 1:].bool()  # positions whose next token exists
    torch.testing.assert_close(padded[valid], expected[valid])
    torch.testing.assert_close(packed[valid], expected[valid], atol=1e-10, rtol=0)
    assert padded.shape == (3, 6) and float(packed[~valid].abs().sum()) == 0.0


def make_critic(path: str, lr: float = 1e-2, **overrides) -> Critic:
    model = load_value_model(path).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Critic(model, optimizer, scheduler, CriticConfig(**overrides))


def test_ppo_step_with_gae_trains_the_critic_alone_in_warmup_then_both(policy_dir):
    path, policy = policy_dir
    policy = policy.double()
    critic = make_critic(path, lr=3e-3, warmup_steps=1, cliprange_value=10.0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    rng = np.random.default_rng(1)
    groups = [make_group(rng, n=3) for _ in range(3)]
    algo = AlgoConfig(advantage="gae")  # λ = 1: the returns are the rewards, a fixed target to learn

    def step(version):
        settings = StepSettings(version=version, max_staleness=4, max_tokens_per_microbatch=32, chunk_tokens=8,
                                grad_clip=1.0)
        return train_step(policy, optimizer, scheduler, groups, algo, settings, critic=critic)

    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    head = critic.model.score.weight.detach().clone()
    warm_step = step(0)
    assert warm_step.stepped and not warm_step.moved  # the version moves on; the policy stays, as it should
    warm = warm_step.metrics
    assert warm["critic/warmup"] == 1.0 and warm["learner/skipped"] == 0.0
    assert all(torch.equal(p, before[name]) for name, p in policy.named_parameters())  # the policy did not move
    assert not torch.equal(critic.model.score.weight, head)
    assert warm["critic/values/mean"] == 0.0  # the zero head's first values
    for key in ("critic/vf_loss", "critic/vpred/mean", "critic/vf_clipfrac", "critic/explained_var",
                "critic/grad_norm", "critic/returns/mean"):
        assert math.isfinite(warm[key]), key
    later = [step(version).metrics for version in range(1, 10)]
    assert later[0]["critic/warmup"] == 0.0
    assert not all(torch.equal(p, before[name]) for name, p in policy.named_parameters())
    assert later[-1]["critic/vf_loss"] < 0.5 * warm["critic/vf_loss"]  # it learns the returns of these groups
    assert later[-1]["critic/explained_var"] > 0.5


def test_gae_advantages_in_the_step_come_from_the_critics_values(policy_dir):
    """The step's advantages are GAE's on the critic's step-start values (checked from the batch the step built)."""
    path, policy = policy_dir
    critic = make_critic(path)
    torch.nn.init.normal_(critic.model.score.weight, std=0.5)
    rng = np.random.default_rng(2)
    groups = [make_group(rng, n=2) for _ in range(2)]
    batch = build_batch(groups)
    values = compute_values(critic.model, batch.input_ids, batch.attention_mask).detach()
    expected, returns = compute_gae_advantages(batch.token_rewards.double(), values.double(), batch.loss_mask,
                                               gamma=0.95, lam=0.8)
    from asyncrl.algos.offpolicy_plan import OffPolicyPlan
    from asyncrl.learner.train_step import compute_advantages

    algo = AlgoConfig(advantage="gae", gamma=0.95, lam=0.8)
    batch.values = values
    got, targets = compute_advantages(batch, groups, batch.token_rewards, algo, OffPolicyPlan.from_algo(algo))
    torch.testing.assert_close(got, expected.float())
    torch.testing.assert_close(targets, returns.float())


def test_vtrace_with_the_critic_baseline_regresses_the_vtrace_targets(policy_dir):
    """algo.vtrace_values=critic: the advantages are V-trace's with the critic's values as V, and the critic's
    targets are v_s (on-policy here, so v_s = R on every token and A_t = R - V_t)."""
    path, policy = policy_dir
    critic = make_critic(path)
    torch.nn.init.normal_(critic.model.score.weight, std=0.5)
    group = make_group(np.random.default_rng(4), n=3)
    batch = build_batch([group])
    batch.logprobs_prox = batch.logprobs_behav.clone()  # on-policy: π = μ
    batch.values = compute_values(critic.model, batch.input_ids, batch.attention_mask).detach()
    from asyncrl.algos.offpolicy_plan import OffPolicyPlan
    from asyncrl.learner.train_step import compute_advantages

    algo = AlgoConfig(loss="reinforce", correction="vtrace", vtrace_values="critic")
    advantages, targets = compute_advantages(batch, [group], batch.token_rewards, algo, OffPolicyPlan.from_algo(algo))
    rewards = torch.tensor([sample.reward for sample in group.samples])[:, None]
    mask = batch.loss_mask
    torch.testing.assert_close(targets, rewards * mask)
    torch.testing.assert_close(advantages, ((rewards - batch.values) * mask).float(), atol=1e-6, rtol=0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    settings = StepSettings(version=0, max_staleness=4, max_tokens_per_microbatch=64, chunk_tokens=8, grad_clip=1.0)
    metrics = train_step(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), [group],
                         algo, settings, critic=critic).metrics
    assert metrics["learner/skipped"] == 0.0 and math.isfinite(metrics["critic/vf_loss"])


def test_checkpoint_keeps_the_critic_and_refuses_a_critic_job_without_one(policy_dir, tmp_path):
    path, policy = policy_dir
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    critic = make_critic(path)
    rng = np.random.default_rng(3)
    settings = StepSettings(version=0, max_staleness=4, max_tokens_per_microbatch=64, chunk_tokens=8, grad_clip=1.0)
    train_step(policy, optimizer, scheduler, [make_group(rng)], AlgoConfig(advantage="gae"), settings,
               critic=critic)
    saved = save_checkpoint(str(tmp_path / "ckpt"), policy, optimizer, scheduler, LearnerState(version=1),
                            keep_last=0, critic=critic)
    fresh = make_critic(path)
    load_checkpoint(saved, policy, optimizer, scheduler, critic=fresh)
    for (name, expected), got in zip(critic.model.state_dict().items(), fresh.model.state_dict().values()):
        torch.testing.assert_close(got, expected, msg=name)
    moments = [state["exp_avg"] for state in critic.optimizer.state.values()]
    assert moments and all(torch.equal(a, b["exp_avg"]) for a, b in zip(moments, fresh.optimizer.state.values()))
    plain = save_checkpoint(str(tmp_path / "plain"), policy, optimizer, scheduler, LearnerState(version=1),
                            keep_last=0)
    with pytest.raises(CheckpointError, match="holds no critic"):
        load_checkpoint(plain, policy, optimizer, scheduler, critic=make_critic(path))
    load_checkpoint(saved, policy, optimizer, scheduler)  # a job without a critic ignores the checkpoint's


def test_config_builds_a_critic_only_for_algorithms_that_read_values():
    assert AlgoConfig(advantage="gae").needs_critic()
    assert AlgoConfig(loss="reinforce", correction="vtrace", vtrace_values="critic").needs_critic()
    assert not AlgoConfig().needs_critic()
    assert load_config(None, ["algo.advantage=gae", "critic.lr=1e-4", "critic.warmup_steps=2",
                              "algo.gamma=0.99", "algo.lam=0.95"]).critic.lr == 1e-4
    with pytest.raises(Exception, match="critic section is set"):
        load_config(None, ["critic.lr=1e-4"])
    with pytest.raises(ValueError, match="algo.lam"):
        AlgoConfig(lam=0.9)
    with pytest.raises(Exception, match="leaves no step"):
        load_config(None, ["algo.advantage=gae", "critic.warmup_steps=5", "learner.total_steps=5"])
    with pytest.raises(ValueError, match="cliprange_value"):
        CriticConfig(cliprange_value=0)
    assert dataclasses.asdict(RunConfig().critic) == dataclasses.asdict(CriticConfig())
