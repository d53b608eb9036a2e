"""Each model family a verl user brings, through the whole path on CPU: the learner trains a step, its checkpoint
is exported (`asyncrl export`), transformers and the real vLLM engine load the export, and vLLM samples with
logprobs within 1e-4 of the learner's; then the learner's next version, published from its in-memory state dict as
a job publishes it, is loaded through the staging path and sampled the same way (Gemma 2, whose vLLM model has no
LM head, needed the tied head's copy left out: vllm_transfer.py). The MoE families stop at the export: vLLM's CPU
experts cannot be reloaded, and the engine says so instead of sampling from garbled experts
(vllm_engine.py::CPU_MOE_UPDATES); their versions' layout is tested in tests/unit/test_checkpoint_layout.py.
Sequences (10 prompt + 12 sampled tokens) cross the sliding window (8) that Mistral and Gemma 2 apply. One engine
per family (~20 s each to start)."""
import asyncio
import copy

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.learner.build import build_optimizer
from asyncrl.learner.checkpoint import save_checkpoint
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.export import export_checkpoint
from asyncrl.learner.families import FAMILIES, build_family_model
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import load_model, load_tokenizer
from asyncrl.learner.state import LearnerState
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = [5, 7, 9, 11, 4, 6, 8, 10, 12, 3]
MOE = {"qwen3_moe", "deepseek_v3"}
"""Sampled from their export only: vLLM 0.32 on CPU refuses to reload an MoE model's weights."""


def trained_export(family: str, tokenizer_dir: str, tmp_path) -> tuple:
    """(the learner's model after one optimizer step, in eval mode; the directory `asyncrl export` wrote)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_family_model(family, len(tokenizer), hidden_size=128, heads=4, kv_heads=2, max_positions=64)
    base = tmp_path / "base"
    model.save_pretrained(base)  # the model directory a user starts from: config and tokenizer
    tokenizer.save_pretrained(base)
    optimizer, scheduler = build_optimizer(model, LearnerConfig(lr=1e-2, warmup_steps=0))
    torch.manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (2, 24))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=1, groups_consumed=1), keep_last=1,
                    model_dir=str(base))
    return model.eval(), export_checkpoint(root, str(tmp_path / "export"))


@pytest.mark.parametrize("family", [family for family in FAMILIES if family != "qwen2"])
def test_each_family_exported_then_published_samples_on_vllm_with_the_learners_logprobs(family, demo_assets, tmp_path):
    from asyncrl.generator.engines.base import EngineOptions, EngineUnsupported
    from asyncrl.generator.engines.vllm_engine import VllmEngine

    model, export = trained_export(family, demo_assets[0], tmp_path)
    reloaded = load_model(export).eval()  # the export round-trips: transformers gives the learner's logits
    ids = torch.tensor([PROMPT * 2])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)

    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 3, 1 << 20), WeightStage(str(tmp_path), "t")

    async def sample_before_and_after_a_version():
        engine = VllmEngine(EngineOptions(export, dtype="float32", max_model_len=64, kv_cache_gib=0.1, seed=0))
        await engine.start()
        try:
            before = await engine.sample(PROMPT, Sampling(temperature=0.7, max_tokens=12), n=2)
            with torch.no_grad():  # the learner's next version
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 0.02)
            state = model.state_dict()
            specs = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]
            staged = stage.stage(publisher.publish(iter(state.items()), 2, specs))
            if family in MOE:  # vLLM's CPU experts cannot be reloaded (vllm_engine.py::CPU_MOE_UPDATES)
                with pytest.raises(EngineUnsupported, match="mixture-of-experts model"):
                    await engine.load_weights(staged)
                return before, None
            assert engine.update_refusal is None
            await engine.load_weights(staged)
            stage.end_load(staged, ok=True)
            after = await engine.sample(PROMPT, Sampling(temperature=0.7, max_tokens=12), n=2)
            return before, after
        finally:
            await engine.close()
            stage.close()
            publisher.close()

    async def a_generators_engine_refuses_at_start():
        engine = VllmEngine(EngineOptions(export, dtype="float32", max_model_len=64, kv_cache_gib=0.1, seed=0,
                                          takes_versions=True))
        try:
            with pytest.raises(EngineUnsupported, match="train MoE models with generator.engine=hf"):
                await engine.start()
        finally:
            await engine.close()

    if family == "qwen3_moe":  # one MoE family is enough for the start-up refusal (an engine start each)
        asyncio.run(a_generators_engine_refuses_at_start())
    torch.manual_seed(3)
    exported = copy.deepcopy(model)
    before, after = asyncio.run(sample_before_and_after_a_version())
    worst = {"export": learner_gap(exported, before)}
    if after is not None:
        assert all(set(completion.versions) == {2} for completion in after)
        worst["published version"] = learner_gap(model, after)
    print(family, worst)  # docs/architecture.md quotes the range (pytest -s)
    assert max(worst.values()) < 1e-4, (family, worst)


def learner_gap(model, completions) -> float:
    """The largest gap between vLLM's logprob of a sampled token and the learner's, over `completions`."""
    worst = 0.0
    for completion in completions:
        assert completion.token_ids
        ids = torch.tensor([PROMPT + completion.token_ids])
        with torch.no_grad():
            logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([0.7]), 64)
        worst = max(worst, float(np.abs(logprobs[0, len(PROMPT) - 1:].numpy() - np.array(completion.logprobs)).max()))
    return worst
