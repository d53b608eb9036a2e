"""Learner pieces on a tiny random Qwen2: chunked tempered logprobs, batch alignment, micro-batch invariance."""
import copy
import time

import numpy as np
import pytest
import torch

from asyncrl.algos.config import AlgoConfig
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.learner.batch import build_batch, split_microbatches
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.train_step import train_step


@pytest.fixture
def model():
    return build_qwen2(vocab_size=32, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0, seed=0).double()


def make_group(rng, n=3, version=0, temperature=0.7):
    prompt = rng.integers(2, 32, size=rng.integers(2, 6)).astype(np.int32)
    samples = []
    for _ in range(n):
        length = int(rng.integers(1, 7))
        samples.append(Sample(completion_ids=rng.integers(2, 32, size=length).astype(np.int32),
                              logprobs=-rng.random(length).astype(np.float32) * 3,
                              versions=np.full(length, version, dtype=np.int32),
                              reward=float(rng.integers(0, 2)), finish_reason="stop"))
    return Group(group_id="g", prompt_id="p", generator_id="t", prompt_ids=prompt, samples=samples,
                 sampling=Sampling(temperature=temperature), created_at=time.time())


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
    batch = build_batch([group], torch.tensor([[1.0, -1.0]]))
    for row, sample in enumerate(group.samples):
        p, c = len(group.prompt_ids), len(sample.completion_ids)
        positions = batch.loss_mask[row].nonzero().squeeze(-1)
        assert positions.tolist() == list(range(p - 1, p - 1 + c))
        assert batch.input_ids[row, positions + 1].tolist() == sample.completion_ids.tolist()
        torch.testing.assert_close(batch.logprobs_behav[row, positions], torch.from_numpy(sample.logprobs))
        assert set(batch.advantages[row, positions].tolist()) == {[1.0, -1.0][row]}
        assert (batch.versions[row][batch.loss_mask[row] == 0] == -1).all()


def test_microbatches_respect_the_token_budget_and_cover_every_row():
    rng = np.random.default_rng(1)
    batch = build_batch([make_group(rng) for _ in range(5)], torch.zeros(5, 3))
    micro = split_microbatches(batch, max_tokens=24)
    assert sum(m.num_rows for m in micro) == batch.num_rows
    assert all(m.input_ids.numel() <= 24 or m.num_rows == 1 for m in micro)


def _gradient_after_step(model, groups, max_tokens):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    captured = {}
    original_step = optimizer.step

    def capture_then_step(*a, **k):
        captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return original_step(*a, **k)

    optimizer.step = capture_then_step
    metrics = train_step(model, optimizer, scheduler, groups, AlgoConfig(), max_tokens, 7, grad_clip=0)
    return metrics, captured


def test_train_step_loss_and_gradients_do_not_depend_on_microbatching(model):
    rng = np.random.default_rng(2)
    groups = [make_group(rng, n=4, temperature=t) for t in (0.7, 1.0, 1.0)]
    reference, grads = _gradient_after_step(model, groups, max_tokens=10_000)
    for budget in (40, 16):
        metrics, other = _gradient_after_step(model, groups, max_tokens=budget)
        assert abs(metrics["loss/pg"] - reference["loss/pg"]) < 1e-9
        for name, grad in grads.items():
            torch.testing.assert_close(other[name], grad, atol=1e-9, rtol=1e-7)


def test_train_step_reports_the_design_metrics(model):
    rng = np.random.default_rng(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = train_step(model, optimizer, scheduler, [make_group(rng) for _ in range(3)], AlgoConfig(), 4096, 64, 1.0)
    for key in ("loss/pg", "reward/mean", "offpolicy/mismatch_k3", "policy/entropy", "perf/learner/tokens_per_s",
                "policy/clip_frac_high", "offpolicy/is_weight/max", "offpolicy/ess", "reward/frac_zero_std_groups"):
        assert np.isfinite(metrics[key]), key
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
