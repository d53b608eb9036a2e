"""Learner pieces on a tiny random Qwen2: chunked tempered logprobs, batch alignment, micro-batch invariance."""
import copy

import numpy as np
import pytest
import torch

from asyncrl.algos.config import LOSS_NAMES, AlgoConfig
from asyncrl.learner.batch import build_batch, split_microbatches
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.train_step import StepSettings, train_step
from tests.groups import make_group


@pytest.fixture
def model():
    return build_qwen2(vocab_size=32, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0, seed=0).double()


def test_chunked_tempered_logprobs_equal_full_log_softmax(model):
    ids = torch.randint(0, 32, (3, 9))
    mask = torch.ones_like(ids)
    temps = torch.tensor([0.7, 1.0, 1.3])
    expected = (model(input_ids=ids).logits[:, :-1].double() / temps[:, None, None].double()).log_softmax(-1)
    expected = expected.gather(-1, ids[:, 1:, None]).squeeze(-1)
    for chunk in (1, 5, 1000):
        got, entropy = compute_logprobs(model, ids, mask, temps, chunk_tokens=chunk, with_entropy=True)
        torch.testing.assert_close(got.double(), expected, atol=1e-10, rtol=0)
        assert entropy.shape == got.shape and bool((entropy >= 0).all())


def test_batch_aligns_completion_tokens_with_logprob_positions():
    rng = np.random.default_rng(0)
    group = make_group(rng, n=2)
    batch = build_batch([group])
    for row, sample in enumerate(group.samples):
        p, c = len(group.prompt_ids), len(sample.completion_ids)
        positions = batch.loss_mask[row].nonzero().squeeze(-1)
        assert positions.tolist() == list(range(p - 1, p - 1 + c))
        assert batch.input_ids[row, positions + 1].tolist() == sample.completion_ids.tolist()
        torch.testing.assert_close(batch.logprobs_behav[row, positions], torch.from_numpy(sample.logprobs))
        assert batch.token_rewards[row, positions].tolist() == [0.0] * (c - 1) + [sample.reward]
        assert (batch.versions[row][batch.loss_mask[row] == 0] == -1).all()


def test_microbatches_respect_the_token_budget_and_cover_every_row():
    rng = np.random.default_rng(1)
    batch = build_batch([make_group(rng) for _ in range(5)])
    micro = split_microbatches(batch, max_tokens=24)
    assert sum(m.num_rows for m in micro) == batch.num_rows
    assert all(m.input_ids.numel() <= 24 or m.num_rows == 1 for m in micro)


def settings(max_tokens, version=0):
    return StepSettings(version=version, max_staleness=2, max_tokens_per_microbatch=max_tokens, chunk_tokens=7,
                        grad_clip=0)


def _gradient_after_step(model, groups, max_tokens, algo=None, ref_model=None):
    """Loss metrics and the gradient of one train_step (SGD with lr 0 records the gradient, changes nothing)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    captured = {}

    def capture(optimizer, args, kwargs):
        for n, p in model.named_parameters():
            if p.grad is not None:
                captured[n] = captured.get(n, 0) + p.grad.clone()

    optimizer.register_step_pre_hook(capture)
    metrics = train_step(model, optimizer, scheduler, groups, algo or AlgoConfig(), settings(max_tokens),
                         ref_model=ref_model).metrics
    return metrics, captured


MICROBATCH_INVARIANT = [(loss, correction) for loss in LOSS_NAMES if loss not in ("clip_cov", "kl_cov", "topr", "sppo")
                        for correction in ("none", "decoupled", "bypass", "tis", "mis", "icepop", "m2po")]
MICROBATCH_INVARIANT += [("topr", "none"), ("reinforce", "vtrace"), ("ppo", "geo_rs"), ("ppo", "k3_rs"),
                         ("sppo", "bypass")]


@pytest.mark.parametrize("loss, correction", MICROBATCH_INVARIANT)
def test_train_step_loss_and_gradients_do_not_depend_on_microbatching(model, loss, correction):
    """Global-count normalisers make the step independent of micro-batch composition (T5) for every loss and
    correction (clip_cov / kl_cov pick tokens per micro-batch, as verl does, so they are excluded)."""
    rng = np.random.default_rng(2)
    groups = [make_group(rng, n=4, temperature=t) for t in (0.7, 1.0, 1.0)]
    algo = AlgoConfig(loss=loss, correction=correction, loss_agg="seq-mean-token-mean",
                      advantage="sppo" if loss == "sppo" else "grpo")  # sppo's loss goes with its advantage
    reference, grads = _gradient_after_step(model, groups, 10_000, algo)
    for budget in (40, 16):
        metrics, other = _gradient_after_step(model, groups, budget, algo)
        assert abs(metrics["loss/pg"] - reference["loss/pg"]) < 1e-9
        for name, grad in grads.items():
            torch.testing.assert_close(other[name], grad, atol=1e-9, rtol=1e-7)


def test_two_minibatches_take_two_optimizer_steps_on_a_frozen_prox(model):
    rng = np.random.default_rng(4)
    groups = [make_group(rng, n=2) for _ in range(4)]
    algo = AlgoConfig(ppo_minibatches=2, loss="ppo", clip_low=0.2, clip_high=0.2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    steps = []
    optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: steps.append(1))
    metrics = train_step(model, optimizer, scheduler, groups, algo, settings(4096)).metrics
    assert len(steps) == 2
    # the second mini-batch trains after an update, so its ratio π_θ/π_prox is no longer exactly 1
    assert metrics["policy/ppo_kl"] != 0.0


def test_kl_loss_to_the_reference_model_is_zero_at_the_start_and_has_gradient(model):
    rng = np.random.default_rng(5)
    groups = [make_group(rng) for _ in range(2)]
    ref = copy.deepcopy(model)
    with_kl, grads_kl = _gradient_after_step(model, groups, 4096, AlgoConfig(kl_loss_coef=0.5, kl_loss_type="k3"), ref)
    without, grads = _gradient_after_step(model, groups, 4096, AlgoConfig())
    assert abs(with_kl["loss/kl"]) < 1e-12  # same weights: KL = 0 ...
    for name in grads:  # ... and k3's gradient at δ = 0 is 0 too
        torch.testing.assert_close(grads_kl[name], grads[name], atol=1e-10, rtol=0)
    shifted = copy.deepcopy(ref)
    with torch.no_grad():
        for p in shifted.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved, grads_moved = _gradient_after_step(model, groups, 4096, AlgoConfig(kl_loss_coef=0.5, kl_loss_type="k3"),
                                              shifted)
    assert moved["loss/kl"] > 0 and moved["kl/ref_k3"] > 0
    assert any(not torch.allclose(grads_moved[n], grads[n]) for n in grads)


def test_kl_reward_penalty_lowers_the_rewards_the_estimator_sees(model):
    from asyncrl.algos.kl import FixedKLController

    rng = np.random.default_rng(6)
    groups = [make_group(rng) for _ in range(2)]
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for p in shifted.parameters():
            p.add_(0.05 * torch.randn_like(p))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics = train_step(model, optimizer, scheduler, groups, AlgoConfig(kl_reward_coef=0.1), settings(4096),
                         ref_model=shifted, kl_controller=FixedKLController(0.1)).metrics
    assert metrics["kl/reward_coef"] == 0.1 and metrics["kl/reward_token_kl"] != 0.0


def test_loglinear_prox_and_remax_run_through_the_step(model):
    rng = np.random.default_rng(7)
    groups = [make_group(rng, version=v) for v in (0, 1, 2)]
    for group in groups:
        group.meta["baseline_reward"] = 0.5
    algo = AlgoConfig(advantage="remax", prox_logprobs="loglinear")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics = train_step(model, optimizer, scheduler, groups, algo, settings(4096, version=2)).metrics
    assert metrics["reward/greedy_baseline/mean"] == 0.5
    assert np.isfinite(metrics["loss/pg"]) and metrics["offpolicy/staleness/max"] == 2


def test_train_step_reports_the_design_metrics(model):
    rng = np.random.default_rng(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    result = train_step(model, optimizer, scheduler, [make_group(rng) for _ in range(3)], AlgoConfig(),
                        StepSettings(version=0, max_staleness=2, max_tokens_per_microbatch=4096, chunk_tokens=64,
                                     grad_clip=1.0))
    assert result.stepped and result.moved
    metrics = result.metrics
    for key in ("loss/pg", "reward/mean", "offpolicy/mismatch_k3", "policy/entropy", "perf/learner/tokens_per_s",
                "policy/clip_frac_high", "offpolicy/is_weight/max", "offpolicy/ess", "reward/frac_zero_std_groups",
                "offpolicy/chi2_seq", "offpolicy/ppl_ratio", "offpolicy/staleness/mean", "offpolicy/staleness/hist/0"):
        assert np.isfinite(metrics[key]), key
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_reference_model_is_needed_only_with_a_kl_coefficient():
    assert not AlgoConfig().needs_reference_model()
    assert AlgoConfig(kl_loss_coef=0.001).needs_reference_model()
    assert AlgoConfig(kl_reward_coef=0.01).needs_reference_model()


def test_resolved_hyperparameters_fill_in_the_published_defaults():
    from asyncrl.learner.objective import resolved_hyperparameters

    resolved = resolved_hyperparameters(AlgoConfig(loss="gspo", correction="tis", is_cap=3.0))
    assert resolved["algo.resolved.gspo.clip_low"] == "0.0003" and resolved["algo.resolved.tis.cap"] == "3.0"
    assert resolved["algo.resolved.tis.level"] == "token"


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(model):
    rng = np.random.default_rng(8)
    groups = [make_group(rng, n=3, temperature=t) for t in (0.7, 1.0, 1.3)]
    results = []
    for packing in (False, True):
        step_model = copy.deepcopy(model)
        optimizer = torch.optim.SGD(step_model.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        grads = {}
        optimizer.register_step_pre_hook(
            lambda o, a, k, m=step_model, g=grads: g.update({n: p.grad.clone() for n, p in m.named_parameters()}))
        config = StepSettings(version=0, max_staleness=2, max_tokens_per_microbatch=40, chunk_tokens=7, grad_clip=0,
                              packing=packing)
        results.append((train_step(step_model, optimizer, scheduler, groups, AlgoConfig(), config).metrics, grads))
    (padded, padded_grads), (packed, packed_grads) = results
    assert abs(padded["loss/pg"] - packed["loss/pg"]) < 1e-12
    assert abs(padded["policy/entropy"] - packed["policy/entropy"]) < 1e-12
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-10, rtol=0)


def test_packed_rows_never_attend_across_sequences(model):
    from asyncrl.learner.logprobs import packed_stream, run_decoder

    ids = torch.randint(2, 32, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, 3:] = 0
    mask[2, 6:] = 0
    ids = ids * mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
    valid = mask.bool()
    packed = run_decoder(model, packed_stream(ids, mask, torch.ones(3)))[0]  # [N, H]
    assert packed.shape[0] == int(valid.sum())
    torch.testing.assert_close(packed, padded[valid], atol=1e-12, rtol=0)
    # the same packed row with plain causal attention leaks earlier sequences into later ones
    flat = model.get_decoder()(input_ids=ids[valid][None], position_ids=position_ids[valid][None]).last_hidden_state[0]
    assert not torch.allclose(flat[3:], padded[valid][3:])


def with_learner_logprobs(model, group, shift: float, temperature: float):
    """The group with each sample's logprobs set to the model's own (at `temperature`) plus `shift`."""
    for sample in group.samples:
        ids = torch.tensor([list(group.prompt_ids) + list(sample.completion_ids)])
        logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([temperature]), 64)
        own = logprobs[0, len(group.prompt_ids) - 1:].detach().double().numpy()
        sample.logprobs = np.minimum(own + shift, 0.0).astype(np.float32)
    return group


@pytest.mark.parametrize("algo", [AlgoConfig(), AlgoConfig(prox_logprobs="recompute"),
                                  AlgoConfig(ppo_minibatches=2, prox_logprobs="recompute")])
def test_token_mult_prob_error_is_one_when_the_engine_matches_and_warns_on_a_framework_gap(model, algo, caplog):
    """NeMo-RL's alert on tokens the learner's own version sampled: exp|Δ| = 1 when the engine's logprobs are the
    learner's; a 0.2-nat gap on every token reads e^0.2 and warns. Stale tokens (v1 at learner v2) are left out of
    /fresh: their gap is the policy moving, which the corrections handle."""
    from asyncrl.learner.step_metrics import warn_on_mismatch

    rng = np.random.default_rng(5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    fresh = [with_learner_logprobs(model, make_group(rng, version=2), 0.0, 0.7) for _ in range(2)]
    stale = [with_learner_logprobs(model, make_group(rng, version=1), -0.5, 0.7)]
    metrics = train_step(model, optimizer, scheduler, fresh + stale, algo, settings(4096, version=2)).metrics
    assert metrics["offpolicy/token_mult_prob_error/fresh"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["offpolicy/token_mult_prob_error"] > 1.2  # the stale group's 0.5 nats count here
    assert 0 < metrics["offpolicy/token_mult_prob_error/fresh_frac"] < 1
    assert not warn_on_mismatch(metrics, 2)
    gap = [with_learner_logprobs(model, make_group(rng, version=2), -0.2, 0.7) for _ in range(2)]
    metrics = train_step(model, optimizer, scheduler, gap, algo, settings(4096, version=2)).metrics
    assert metrics["offpolicy/token_mult_prob_error/fresh"] == pytest.approx(np.exp(0.2), abs=1e-4)
    with caplog.at_level("WARNING"):
        assert warn_on_mismatch(metrics, 2)
    assert "token_mult_prob_error = 1.2214" in caplog.text and "not staleness" in caplog.text


def test_each_reward_component_is_averaged_over_the_samples_that_carry_it():
    """reward.functions: the generator puts each component in reward_info as reward/<name>; a failed reward call
    carries none and is left out of the means."""
    from asyncrl.learner.step_metrics import component_means

    rng = np.random.default_rng(0)
    groups = [make_group(rng), make_group(rng)]
    infos = [{"reward/correct": 1.0, "reward/format": 0.5, "correct/answer_found": 1.0},
             {"reward/correct": 0.0, "reward/format": 1.0, "reward/made_up_by_a_generator": 3.0},
             {"reward_error": 1.0}]
    for group in groups:
        for sample, info in zip(group.samples, infos):
            sample.reward_info = dict(info)
    assert component_means(groups, ["correct", "format"]) == {"reward/correct/mean": 0.5, "reward/format/mean": 0.75}


def test_the_entropy_with_its_gradient_matches_the_full_softmax(model):
    """with_entropy="grad" (algo.entropy_coef): the same values as the detached metric, and the gradient of the
    entropy of the full tempered softmax."""
    ids = torch.randint(0, 32, (2, 7))
    mask = torch.ones_like(ids)
    temps = torch.tensor([0.8, 1.2])
    detached = compute_logprobs(model, ids, mask, temps, chunk_tokens=5, with_entropy=True)[1]
    _, entropy = compute_logprobs(model, ids, mask, temps, chunk_tokens=5, with_entropy="grad")
    torch.testing.assert_close(entropy.detach(), detached, atol=1e-12, rtol=0)
    entropy.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    log_probs = (model(input_ids=ids).logits[:, :-1].double() / temps[:, None, None].double()).log_softmax(-1)
    (-(log_probs.exp() * log_probs).sum(-1)).sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, atol=1e-10, rtol=1e-8)


def test_the_entropy_bonus_is_subtracted_from_the_loss_and_does_not_depend_on_microbatching(model):
    rng = np.random.default_rng(5)
    groups = [make_group(rng, n=3, temperature=t) for t in (0.7, 1.0)]
    plain, plain_grads = _gradient_after_step(model, groups, 10_000, AlgoConfig(loss_agg="seq-mean-token-mean"))
    algo = AlgoConfig(loss_agg="seq-mean-token-mean", entropy_coef=0.01)
    bonus, grads = _gradient_after_step(model, groups, 10_000, algo)
    assert bonus["loss/entropy"] > 0 and plain["loss/entropy"] == 0.0
    assert bonus["loss/total"] == pytest.approx(bonus["loss/pg"] - 0.01 * bonus["loss/entropy"], abs=1e-12)
    assert any(not torch.allclose(grads[name], plain_grads[name]) for name in grads)
    split, split_grads = _gradient_after_step(model, groups, 16, algo)
    assert split["loss/entropy"] == pytest.approx(bonus["loss/entropy"], abs=1e-9)
    for name, grad in grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-9, rtol=1e-7)
    with pytest.raises(ValueError, match="entropy_coef must be >= 0"):
        AlgoConfig(entropy_coef=-0.1)


def test_batch_normalised_weights_are_computed_once_and_do_not_depend_on_microbatching(model):
    rng = np.random.default_rng(6)
    groups = [make_group(rng, n=3, version=0, temperature=t) for t in (0.7, 1.0)]
    for group in groups:  # a stale sampler: the behaviour logprobs are off by a per-token amount
        for sample in group.samples:
            sample.logprobs = sample.logprobs + rng.normal(0, 0.3, size=len(sample.logprobs)).astype(np.float32)
    algo = AlgoConfig(correction="tis", is_batch_norm=True, loss_agg="seq-mean-token-mean")
    whole, grads = _gradient_after_step(model, groups, 10_000, algo)
    assert whole["offpolicy/batch_norm_factor"] > 0 and whole["offpolicy/batch_norm_factor"] != 1.0
    split, split_grads = _gradient_after_step(model, groups, 16, algo)
    assert split["loss/pg"] == pytest.approx(whole["loss/pg"], abs=1e-9)
    for name, grad in grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-9, rtol=1e-7)
