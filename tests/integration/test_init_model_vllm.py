"""A model `asyncrl init-model` builds (learner/init_model.py), in each family it offers, through the real vLLM CPU
engine: vLLM loads the directory's config and tokenizer and samples a chat-rendered prompt with the logprobs the
learner computes on the same directory. The default family only: an engine costs ~20 s to start, and every
family's export is sampled by vLLM in test_families_vllm.py; what is new here is the tokenizer init-model trains."""
import asyncio

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.learner.init_model import FAMILIES, ModelShape, init_model
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import load_model, load_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_samples_an_init_model_directory_with_the_learners_logprobs(tmp_path):
    family = FAMILIES[0]
    from asyncrl.generator.engines.base import EngineOptions
    from asyncrl.generator.engines.vllm_engine import VllmEngine

    rows = [{"prompt": [{"role": "user", "content": f"Wie viel ist {a} + {a}? Kurz."}],
             "reward_model": {"ground_truth": str(2 * a)}} for a in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "train.parquet"))
    built = init_model(str(tmp_path / family), [str(tmp_path / "train.parquet")], ModelShape(family, 64, 2), seed=0)
    tokenizer, model = load_tokenizer(built.path), load_model(built.path).eval()
    prompt = tokenizer.apply_chat_template([rows[3]["prompt"][0]], tokenize=True, add_generation_prompt=True,
                                           return_dict=False)

    async def sample():
        engine = VllmEngine(EngineOptions(built.path, dtype="float32", max_model_len=128, kv_cache_gib=0.1, seed=0))
        await engine.start()
        try:
            return await engine.sample(prompt, Sampling(temperature=0.7, max_tokens=12), n=2)
        finally:
            await engine.close()

    worst = 0.0
    for completion in asyncio.run(sample()):
        assert completion.token_ids and max(completion.token_ids) < built.vocab_size
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([0.7]), 64)
        worst = max(worst, float(np.abs(logprobs[0, len(prompt) - 1:].numpy() - np.array(completion.logprobs)).max()))
    assert worst < 1e-4, (family, worst)
