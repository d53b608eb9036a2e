"""LoRA versions on the real vLLM CPU engine: each published adapter is served with the learner's greedy tokens
and logprobs, a request keeps the adapter it started on while newer versions arrive, old adapters leave once
nothing runs on them, and the merged export's weights give the learner's greedy tokens too."""
import asyncio

import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.learner.build import build_optimizer
from asyncrl.learner.checkpoint import save_checkpoint
from asyncrl.learner.config import LearnerConfig, LoraSettings
from asyncrl.learner.export import export_checkpoint
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.lora import apply_lora
from asyncrl.learner.model import load_model
from asyncrl.learner.parallel import ParallelState
from asyncrl.learner.publish import outgoing_version
from asyncrl.learner.state import LearnerState
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage

pytestmark = pytest.mark.vllm
SETTINGS = LoraSettings(rank=4, alpha=8.0)
PROMPTS = [[5, 7, 9, 3, 11], [4, 6, 8, 2, 10, 12]]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(demo_assets, loop):
    from asyncrl.generator.engines.base import EngineOptions, VllmOptions
    from asyncrl.generator.engines.vllm_engine import VllmEngine

    engine = VllmEngine(EngineOptions(demo_assets[0], dtype="float32", max_model_len=64, kv_cache_gib=0.25, seed=0,
                                      vllm=VllmOptions(lora_rank=SETTINGS.rank, max_loras=2)))
    try:
        loop.run_until_complete(engine.start())
        yield engine
    finally:
        loop.run_until_complete(engine.close())


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(publisher, stage) of a learner and a generator on this host."""
    root = tmp_path_factory.mktemp("lora-weights")
    publisher = WeightPublisher(str(root / "ring"), slots=3, bucket_bytes=1 << 20)
    stage = WeightStage(str(root), "gen")
    yield publisher, stage
    publisher.close()


def learner_model(model_dir: str, seed: int):
    """The demo model with adapters whose B is random: what a learner holds after some LoRA steps."""
    model = apply_lora(load_model(model_dir), SETTINGS)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.5)
    return model.eval()


def load(engine, loop, weights, model, version: int, lora: LoraSettings = SETTINGS) -> None:
    publisher, stage = weights
    outgoing = outgoing_version(model, ParallelState(), lora, "float32", 1 << 20)
    staged = stage.stage(publisher.publish(outgoing.weights, version, outgoing.specs, extra=outgoing.extra))
    loop.run_until_complete(engine.load_weights(staged, stage.good))
    stage.end_load(staged, ok=True)


def greedy(model, prompt: list, steps: int) -> list:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def learner_logprobs(model, prompt: list, completion: list, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([temperature]), 64)
    return logprobs[0, len(prompt) - 1:]


def test_vllm_serves_each_adapter_with_the_learners_greedy_tokens_and_logprobs(engine, loop, weights, demo_assets):
    base = load_model(demo_assets[0]).eval()
    for version, seed in ((1, 1), (2, 2)):
        model = learner_model(demo_assets[0], seed)
        load(engine, loop, weights, model, version)
        assert engine.version == version and engine.adapters.current.version == version
        differs = False
        for prompt in PROMPTS:
            completion = loop.run_until_complete(engine.sample(prompt, Sampling(temperature=0.0, max_tokens=8), 1))[0]
            assert completion.token_ids == greedy(model, prompt, len(completion.token_ids))
            differs |= completion.token_ids != greedy(base, prompt, len(completion.token_ids))
            assert completion.versions == [version] * len(completion.token_ids)
        assert differs, "the adapter changed no greedy token: the test would not see it missing"
        sampled = loop.run_until_complete(engine.sample(PROMPTS[0], Sampling(temperature=0.7, max_tokens=8), 4))
        for completion in sampled:
            expected = learner_logprobs(model, PROMPTS[0], completion.token_ids, 0.7)
            got = torch.tensor(completion.logprobs, dtype=expected.dtype)
            assert (got - expected).abs().max().item() < 1e-4


def test_a_request_keeps_its_adapter_while_newer_versions_load(engine, loop, weights, demo_assets):
    first, second = learner_model(demo_assets[0], 3), learner_model(demo_assets[0], 4)
    load(engine, loop, weights, first, 3)

    async def race():
        running = asyncio.ensure_future(engine.sample(PROMPTS[1], Sampling(temperature=1.0, max_tokens=40), 1))
        while not any(c.token_ids for c in engine.in_flight.values()):  # sampling on v3 has begun
            await asyncio.sleep(0.005)
        staged_version = 4
        publisher, stage = weights
        outgoing = outgoing_version(second, ParallelState(), SETTINGS, "float32", 1 << 20)
        staged = stage.stage(publisher.publish(outgoing.weights, staged_version, outgoing.specs,
                                               extra=outgoing.extra))
        await engine.load_weights(staged, stage.good)  # no pause: the running request goes on
        stage.end_load(staged, ok=True)
        loaded_while_running = [served.version for served in engine.adapters.loaded]
        return (await running)[0], loaded_while_running

    completion, loaded_while_running = loop.run_until_complete(race())
    assert engine.version == 4 and loaded_while_running[-2:] == [3, 4]
    assert completion.versions == [3] * len(completion.token_ids) and len(completion.token_ids) > 1
    expected = learner_logprobs(first, PROMPTS[1], completion.token_ids, 1.0)
    got = torch.tensor(completion.logprobs, dtype=expected.dtype)
    assert (got - expected).abs().max().item() < 1e-4  # every token from v3's adapter, none from v4's
    assert (got - learner_logprobs(second, PROMPTS[1], completion.token_ids, 1.0)).abs().max().item() > 1e-3
    assert [served.version for served in engine.adapters.loaded] == [3, 4]  # max_loras = 2: v1, v2 left
    assert sorted(loop.run_until_complete(engine._engine.list_loras())) == sorted(
        served.lora_id for served in engine.adapters.loaded)


def test_the_merged_export_gives_the_learners_greedy_tokens_on_vllm(engine, loop, weights, demo_assets,
                                                                    tmp_path):
    """`asyncrl export` of a LoRA checkpoint, its merged weights loaded into vLLM as a full version: the learner's
    (adapter) greedy tokens, with no adapter applied any more."""
    model = learner_model(demo_assets[0], 5)
    optimizer, scheduler = build_optimizer(model, LearnerConfig(warmup_steps=0))
    save_checkpoint(str(tmp_path / "ckpt"), model, optimizer, scheduler, LearnerState(version=5), keep_last=1,
                    model_dir=demo_assets[0])
    merged = load_model(export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "merged")))
    assert not any("lora" in name for name in merged.state_dict())
    load(engine, loop, weights, merged, 6, lora=LoraSettings())
    assert engine.adapters.current is None and not engine.adapters.loaded  # they belonged to the old base
    for prompt in PROMPTS:
        completion = loop.run_until_complete(engine.sample(prompt, Sampling(temperature=0.0, max_tokens=8), 1))[0]
        assert completion.token_ids == greedy(model, prompt, len(completion.token_ids))
        assert completion.versions == [6] * len(completion.token_ids)
