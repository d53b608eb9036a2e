"""The real SGLang engine on the tiny demo Qwen2: sampling, then one version loaded from the generator's staging.

Needs CUDA and SGLang (skipped otherwise). The version goes in the production way: the learner's WeightPublisher
writes it to its shared-memory ring, the generator's WeightStage copies and verifies it into a staging slot, and
`SglangEngine.load_weights` hands the slot's CPU tensors to SGLang's `update_weights_from_tensor`.
"""
import asyncio

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def perturbed_parameters(model_dir: str) -> list:
    """(name, bf16 CPU tensor) of every parameter, moved off the checkpoint so a load is visible."""
    from asyncrl.learner.model import load_model

    generator = torch.Generator().manual_seed(1)
    return [(name, (param.detach() + 0.05 * torch.randn(param.shape, generator=generator)).to(torch.bfloat16))
            for name, param in load_model(model_dir).named_parameters()]


def test_real_sglang_samples_then_loads_a_staged_version(demo_assets, tmp_path):
    pytest.importorskip("sglang")
    from asyncrl.generator.engines.base import EngineOptions, SglangOptions
    from asyncrl.generator.engines.sglang_engine import SglangEngine
    from asyncrl.weightsync.publisher import WeightPublisher
    from asyncrl.weightsync.receiver import WeightStage

    model_dir = demo_assets[0]
    engine = SglangEngine(EngineOptions(model_dir, "bfloat16", max_model_len=64, kv_cache_gib=0.25, seed=0,
                                        sglang=SglangOptions(timeout_s=300, server_args={
                                            "attention_backend": "triton", "disable_cuda_graph": True,
                                            "mem_fraction_static": 0.3})))
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 2, 1 << 24), WeightStage(str(tmp_path), "sglang")
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    try:
        prompt = [5, 7, 9, 3]
        before = loop.run_until_complete(engine.sample(prompt, Sampling(temperature=0.7, max_tokens=8), n=2))
        for completion in before:
            assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) > 0
            assert set(completion.versions) == {0} and all(lp <= 0 for lp in completion.logprobs)

        named = perturbed_parameters(model_dir)
        specs = [(name, "bfloat16", tuple(tensor.shape)) for name, tensor in named]
        staged = stage.stage(publisher.publish(iter(named), 1, specs))
        loop.run_until_complete(engine.load_weights(staged, None))
        stage.end_load(staged, ok=True)
        assert engine.version == 1

        sent = dict(named)["model.norm.weight"].float().numpy()
        got = np.asarray(loop.run_until_complete(engine._engine.get_weights_by_name("model.norm.weight", 100)),
                         dtype=np.float32).reshape(-1)
        np.testing.assert_allclose(got, sent[: got.size], atol=1e-2)
        after = loop.run_until_complete(engine.sample(prompt, Sampling(temperature=0.7, max_tokens=8), n=2))
        assert all(set(completion.versions) == {1} for completion in after)
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
        stage.close()
        publisher.close()
