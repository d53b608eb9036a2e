"""The transformers engine on the demo model: requests that arrive together are decoded in one left-padded batch,
and every row samples and scores exactly as it would alone (logprobs match the learner's recomputation)."""
import asyncio

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.generator.engines.base import EngineOptions
from asyncrl.generator.engines.hf_engine import HfEngine
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import load_model

PROMPTS = [[12, 5, 7, 9, 3], [4, 6, 8, 2, 10, 11, 13, 14], [9, 3]]  # different lengths: the batch is padded


@pytest.fixture(scope="module")
def model(demo_assets):
    return load_model(demo_assets[0]).eval()


def learner_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([temperature]), 64)
    return logprobs[0, len(prompt) - 1:].numpy()


async def sample_together(engine, requests):
    await engine.start()
    try:
        return await asyncio.gather(*(engine.sample(prompt, sampling, n) for prompt, sampling, n in requests))
    finally:
        await engine.close()


def test_concurrent_requests_share_one_padded_batch_and_match_the_learner(demo_assets, model):
    engine = HfEngine(EngineOptions(demo_assets[0], "float32", max_model_len=64, kv_cache_gib=1, seed=0))
    sampling = Sampling(temperature=0.7, max_tokens=8)
    groups = asyncio.run(sample_together(engine, [(prompt, sampling, 4) for prompt in PROMPTS]))
    assert engine.batches == 1 and engine.batched_seqs == 12
    worst = 0.0
    for prompt, group in zip(PROMPTS, groups):
        assert len(group) == 4
        for completion in group:
            assert 0 < len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) <= 8
            if completion.finish_reason == "stop":
                assert completion.token_ids[-1] in engine.eos_token_id
                assert not set(completion.token_ids[:-1]) & set(engine.eos_token_id)
            else:
                assert len(completion.token_ids) == 8
            expected = learner_logprobs(model, prompt, completion.token_ids, 0.7)
            worst = max(worst, float(np.max(np.abs(expected - np.array(completion.logprobs)))))
    assert worst < 1e-4, worst


def test_requests_of_different_n_are_prefilled_once_and_each_row_matches_the_learner(demo_assets, model):
    """Each request's prompt is prefilled once and copied to its n rows; rows that stop early leave the batch. Every
    row must still sample from its own prompt and score as the learner does."""
    engine = HfEngine(EngineOptions(demo_assets[0], "float32", max_model_len=64, kv_cache_gib=1, seed=1))
    sampling = Sampling(temperature=1.0, max_tokens=8)
    ns = [1, 5, 2]
    groups = asyncio.run(sample_together(engine, [(prompt, sampling, n) for prompt, n in zip(PROMPTS, ns)]))
    assert engine.batches == 1 and [len(group) for group in groups] == ns
    lengths = set()
    for prompt, group in zip(PROMPTS, groups):
        for completion in group:
            lengths.add(len(completion.token_ids))
            expected = learner_logprobs(model, prompt, completion.token_ids, 1.0)
            assert np.max(np.abs(expected - np.array(completion.logprobs))) < 1e-4
    assert len(lengths) > 1  # (seeded) some rows stopped while others decoded on: the batch shrank under them


def test_requests_that_sample_differently_are_decoded_in_separate_batches(demo_assets):
    engine = HfEngine(EngineOptions(demo_assets[0], "float32", max_model_len=64, kv_cache_gib=1, seed=0))
    tempered, greedy = Sampling(temperature=1.0, max_tokens=6), Sampling(temperature=0.0, max_tokens=6)
    first, baseline, second = asyncio.run(sample_together(
        engine, [(PROMPTS[0], tempered, 3), (PROMPTS[0], greedy, 1), (PROMPTS[1], tempered, 3)]))
    assert engine.batches == 2 and engine.batched_seqs == 7  # the greedy baseline waited for its own batch
    assert len(first) == len(second) == 3 and len(baseline) == 1
    assert all(logprob == 0.0 for logprob in baseline[0].logprobs)  # a point mass: greedy decoding


@pytest.mark.parametrize("every_token_ends", [False, True])
def test_a_prompt_at_max_model_len_gets_an_empty_length_completion(demo_assets, every_token_ends):
    """Even when the draw it makes with no room left is an end token (every token is one, in the second case): a
    completion with no token never says it stopped (the learner refuses that as bad_finish_reason)."""
    engine = HfEngine(EngineOptions(demo_assets[0], "float32", max_model_len=len(PROMPTS[1]), kv_cache_gib=1, seed=0))
    requests = [(PROMPTS[1], Sampling(temperature=1.0, max_tokens=4), 2),
                (PROMPTS[0], Sampling(temperature=1.0, max_tokens=4), 2)]

    async def run():
        await engine.start()
        if every_token_ends:
            engine.eos_token_id = list(range(engine.model.config.vocab_size))
        try:
            return await asyncio.gather(*(engine.sample(prompt, sampling, n) for prompt, sampling, n in requests))
        finally:
            await engine.close()

    long, short = asyncio.run(run())
    assert [c.token_ids for c in long] == [[], []] and {c.finish_reason for c in long} == {"length"}
    assert all(0 < len(c.token_ids) <= len(PROMPTS[1]) - len(PROMPTS[0]) for c in short)
    if every_token_ends:
        assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in short)
