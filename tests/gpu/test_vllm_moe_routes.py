"""Routing replay against vLLM on CUDA: vLLM returns the experts of every token (`enable_return_routed_experts`, its
Model Runner V2, which needs Triton: no CPU run), the group carries them, and the learner's logprobs on vLLM's
routes match vLLM's within 1e-4 in fp32 on a tiny Qwen3-MoE; without replay the gap is reported. Needs CUDA and the
`gpu` extra's vLLM; scripts/test_gpu runs it. The CPU counterpart (the hf engine records the routes) is
tests/integration/test_moe_routing_replay.py."""
import asyncio

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = [5, 7, 9, 11, 4, 6, 8, 10, 12, 3]


def test_vllm_returns_routes_the_learner_replays_to_vllms_logprobs(demo_assets, tmp_path):
    pytest.importorskip("vllm")
    from asyncrl.generator.engines.base import EngineOptions, VllmOptions
    from asyncrl.generator.engines.vllm_engine import VllmEngine
    from asyncrl.learner.families import build_family_model
    from asyncrl.learner.logprobs import compute_logprobs
    from asyncrl.learner.model import load_model, load_tokenizer
    from asyncrl.moe.routing import RoutingReplay, routing_shape

    tokenizer = load_tokenizer(demo_assets[0])
    path = str(tmp_path / "moe")
    build_family_model("qwen3_moe", len(tokenizer), hidden_size=128, max_positions=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    engine = VllmEngine(EngineOptions(path, dtype="float32", max_model_len=64, kv_cache_gib=0.25, seed=0,
                                      record_routes=True, vllm=VllmOptions(gpu_memory_utilization=0.2)))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    try:
        completions = loop.run_until_complete(engine.sample(PROMPT, Sampling(temperature=1.0, max_tokens=12), n=4))
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    model = load_model(path).to("cuda").eval()
    shape = routing_shape(model.config)
    replay = RoutingReplay(model, *shape)
    gaps = {"replay": 0.0, "own routes": 0.0}
    for completion in completions:
        routes = np.asarray(completion.routed_experts)
        length = len(PROMPT) + len(completion.token_ids)
        assert routes.shape == (length - 1, shape[0], shape[1]), routes.shape
        ids = torch.tensor([PROMPT + completion.token_ids], device="cuda")
        padded = torch.full((1, length, shape[0], shape[1]), -1, dtype=torch.int16)
        padded[0, :length - 1] = torch.from_numpy(routes.astype(np.int16))
        for mode, replayed in (("replay", padded.to("cuda")), ("own routes", None)):
            replay.set_routes(replayed)
            with torch.no_grad():
                logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([1.0], device="cuda"),
                                               64)
            gap = np.abs(logprobs[0, len(PROMPT) - 1:].cpu().numpy() - np.array(completion.logprobs)).max()
            gaps[mode] = max(gaps[mode], float(gap))
    replay.remove()
    print(f"vLLM routes replayed: max |Δ logprob| {gaps}")
    assert gaps["replay"] < 1e-4, gaps
