"""`asyncrl export` output served by the real vLLM engine: a checkpoint of a perturbed demo model, exported, then
loaded by vLLM and by transformers, must give the learner model's greedy tokens, logprobs and logits."""
import asyncio

import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.data.prompts import read_rows, tokenize_rows
from asyncrl.learner.build import build_optimizer
from asyncrl.learner.checkpoint import save_checkpoint
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.export import export_checkpoint
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import load_model, load_tokenizer
from asyncrl.learner.state import LearnerState

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def event_loop_runner():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def exported(demo_assets, tmp_path_factory):
    """(the learner's perturbed model in eval mode, the export directory, two prompts' token ids)."""
    model_dir, files = demo_assets
    model = load_model(model_dir).train()
    optimizer, scheduler = build_optimizer(model, LearnerConfig(lr=1e-3, warmup_steps=0))
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # one step: the export must carry the trained weights, not the base model's
    scheduler.step()
    root = str(tmp_path_factory.mktemp("ckpt"))
    save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=1, groups_consumed=1), keep_last=1,
                    model_dir=model_dir)
    out = export_checkpoint(root, str(tmp_path_factory.mktemp("export")))
    base = load_model(model_dir).state_dict()
    assert any(not torch.equal(base[k], v) for k, v in model.state_dict().items())
    rows, _ = tokenize_rows(read_rows(files)[:2], load_tokenizer(out), max_prompt_tokens=48)  # exported tokenizer
    return model.eval(), out, [row.prompt_ids for row in rows]


@pytest.fixture(scope="module")
def vllm_engine(exported, event_loop_runner):
    from asyncrl.generator.engines.base import EngineOptions
    from asyncrl.generator.engines.vllm_engine import VllmEngine

    engine = VllmEngine(EngineOptions(exported[1], dtype="float32", max_model_len=64, kv_cache_gib=0.25, seed=0))
    try:
        event_loop_runner.run_until_complete(engine.start())
        yield engine
    finally:
        event_loop_runner.run_until_complete(engine.close())


def test_vllm_serves_the_export_with_the_learners_greedy_tokens_and_logprobs(vllm_engine, exported,
                                                                           event_loop_runner):
    model, _, prompts = exported
    for prompt in prompts:
        completion = event_loop_runner.run_until_complete(
            vllm_engine.sample(prompt, Sampling(temperature=0.0, max_tokens=MAX_TOKENS), n=1))[0]
        assert completion.token_ids
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(len(completion.token_ids)):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            assert completion.token_ids == ids[len(prompt):]
            # vLLM reports a greedy request's logprobs from the unscaled logits: temperature 1 on the learner side.
            full = torch.tensor([ids])
            logprobs, _ = compute_logprobs(model, full, torch.ones_like(full), torch.tensor([1.0]), 64)
        expected = logprobs[0, len(prompt) - 1:]
        got = torch.tensor(completion.logprobs, dtype=expected.dtype)
        assert (got - expected).abs().max().item() < 1e-4, (got, expected)


def test_export_loads_in_transformers_with_identical_logits(exported):
    from transformers import AutoModelForCausalLM

    model, out, prompts = exported
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
