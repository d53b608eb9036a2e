"""LoRA RL in one process: only the adapters train and publish, in PEFT's own file format; the hf engine serves a
published adapter with the learner's logits; hostile adapter messages are refused; the vLLM engine's adapter set
keeps the admitted versions and those still in use; checkpoints resume the adapter and export merges it. The
multi-rank match is in tests/integration/test_parallel.py, the real vLLM engine in test_lora_vllm.py."""
import asyncio
import dataclasses
import math
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from asyncrl.buffer.group import Sampling
from asyncrl.generator.engines.base import EngineOptions, WeightLoadError
from asyncrl.generator.engines.hf_engine import HfEngine
from asyncrl.generator.engines.lora_adapter import (ServedAdapters, parse_adapter, vllm_max_lora_rank,
                                                    write_adapter_dir)
from asyncrl.launch.cli import main as cli_main
from asyncrl.learner.build import build_optimizer
from asyncrl.learner.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from asyncrl.learner.config import LearnerConfig, LoraSettings
from asyncrl.learner.export import export_checkpoint
from asyncrl.learner.lora import apply_lora
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.parallel import ParallelState
from asyncrl.learner.publish import outgoing_version, repeats_previous
from asyncrl.learner.state import LearnerState
from asyncrl.weightsync.layout import announcement_for, plan_layout
from asyncrl.weightsync.lora_names import adapter_module_key, is_adapter_key
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage

VOCAB = 48
SETTINGS = LoraSettings(rank=4, alpha=8.0)


def tiny(seed: int = 0):
    return build_qwen2(vocab_size=VOCAB, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0, seed=seed)


def lora_model(b_seed: int = 1, settings: LoraSettings = SETTINGS):
    """tiny() with adapters whose B is random (a fresh adapter's B is zero: it would change nothing)."""
    model = apply_lora(tiny(), settings)
    torch.manual_seed(b_seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.3)
    return model.eval()


def adapter_state(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items() if is_adapter_key(name)}


def publish(publisher, model, version: int) -> dict:
    outgoing = outgoing_version(model, ParallelState(), SETTINGS, "float32", 1 << 20)
    return publisher.publish(outgoing.weights, version, outgoing.specs, extra=outgoing.extra)


@pytest.fixture
def model_dir(tmp_path):
    path = str(tmp_path / "base")
    tiny().save_pretrained(path)
    return path


def test_only_the_adapters_train_and_the_optimizer_holds_state_for_them_alone():
    model = apply_lora(tiny(), SETTINGS)
    ids = torch.randint(2, VOCAB, (2, 10))
    with torch.no_grad():  # B starts at zero: version 0 is the base model
        torch.testing.assert_close(model(input_ids=ids).logits, tiny()(input_ids=ids).logits, atol=0, rtol=0)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all(is_adapter_key(name) for name in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B on q, k, v, o, gate, up, down of 2 layers
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer, scheduler = build_optimizer(model, LearnerConfig(lr=1e-2, warmup_steps=0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(optimizer.state) == len(trainable)  # Adam moments for the adapters, none for the base
    moved = {name for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])}
    assert moved and moved <= trainable
    assert any(".lora_A." in name for name in moved)  # A moves once B is off zero (the second step)


def test_a_version_is_the_adapter_alone_named_as_peft_saves_it(tmp_path):
    from peft import get_peft_model
    from asyncrl.learner.lora import peft_lora_config

    model = lora_model()
    outgoing = outgoing_version(model, ParallelState(), SETTINGS, "bfloat16", 1 << 20)
    published = dict(outgoing.weights)
    peft_model = get_peft_model(tiny(), peft_lora_config(SETTINGS))
    peft_model.save_pretrained(str(tmp_path / "peft"))
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(published) == {name for name, _, _ in outgoing.specs}
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, model.state_dict()[adapter_module_key(name)], atol=0, rtol=0)
    assert outgoing.extra == {"lora": {"r": 4, "lora_alpha": 8.0, "target_modules": SETTINGS.target_modules}}
    adapter_bytes = sum(math.prod(shape) * 2 for _, _, shape in outgoing.specs)
    full = outgoing_version(tiny(), ParallelState(), LoraSettings(), "bfloat16", 1 << 20)
    assert full.extra is None and outgoing.full_bytes == full.full_bytes  # the base's size, without base_layer
    assert adapter_bytes / outgoing.full_bytes < 0.2


def test_a_publish_that_repeats_the_previous_bytes_is_flagged(tmp_path):
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=3, bucket_bytes=1 << 20)
    try:
        model = lora_model()
        repeated, key = repeats_previous(None, publish(publisher, model, 1))
        assert not repeated
        repeated, key = repeats_previous(key, publish(publisher, model, 2))  # nothing trained in between
        assert repeated
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if ".lora_B." in n).add_(1e-3)
        repeated, _ = repeats_previous(key, publish(publisher, model, 3))
        assert not repeated
    finally:
        publisher.close()


def test_the_hf_engine_serves_each_published_adapter_with_the_learners_logits(tmp_path, model_dir):
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=3, bucket_bytes=1 << 20)
    stage = WeightStage(str(tmp_path), "gen")
    engine = HfEngine(EngineOptions(model_dir, dtype="float32", max_model_len=64, kv_cache_gib=0.1, seed=0))
    ids = torch.randint(2, VOCAB, (1, 10))

    async def scenario():
        await engine.start()
        try:
            await serve()
        finally:
            await engine.close()

    async def serve():
        for version, b_seed in ((1, 1), (2, 2)):
            learner = lora_model(b_seed)
            staged = stage.stage(publish(publisher, learner, version))
            await engine.load_weights(staged, stage.good)
            stage.end_load(staged, ok=True)
            assert engine.version == version
            with torch.no_grad():
                torch.testing.assert_close(engine.model(input_ids=ids).logits, learner(input_ids=ids).logits,
                                           atol=1e-5, rtol=0)
            completion = (await engine.sample(ids[0].tolist(), Sampling(temperature=0.0, max_tokens=6), 1))[0]
            expected = ids[0].tolist()
            with torch.no_grad():
                for _ in completion.token_ids:
                    expected.append(int(learner(input_ids=torch.tensor([expected])).logits[0, -1].argmax()))
            assert completion.token_ids == expected[10:] and completion.versions == [version] * 6
        wider = LoraSettings(rank=8, alpha=8.0)
        outgoing = outgoing_version(lora_model(settings=wider), ParallelState(), wider, "float32", 1 << 20)
        staged = stage.stage(publisher.publish(outgoing.weights, 3, outgoing.specs, extra=outgoing.extra))
        with pytest.raises(WeightLoadError, match="rank"):  # the injected adapters have rank 4
            await engine.load_weights(staged, stage.good)
        stage.end_load(staged, ok=False)
        assert engine.version == 2

    try:
        asyncio.run(scenario())
    finally:
        publisher.close()


def announced(version: int, specs: list, extra: dict, publisher: str = "life-1"):
    """The announcement the publisher makes of a LoRA version with these specs (checksums are not read here)."""
    layout = plan_layout(specs, 1 << 20)
    return announcement_for(layout, version, ["0" * 16] * len(layout.bucket_sizes), publisher=publisher,
                            published_at=0.0, **extra)


def adapter_message(model=None, **changes):
    outgoing = outgoing_version(model or lora_model(), ParallelState(), SETTINGS, "float32", 1 << 20)
    return dataclasses.replace(announced(3, outgoing.specs, outgoing.extra), **changes)


BASE_SHAPES = {name: tuple(tensor.shape) for name, tensor in tiny().state_dict().items()}


@pytest.mark.parametrize("changes, match", [
    ({"lora": {"r": 0, "lora_alpha": 8.0, "target_modules": ["q_proj"]}}, "rank"),
    ({"lora": {"r": True, "lora_alpha": 8.0, "target_modules": ["q_proj"]}}, "rank"),
    ({"lora": {"r": 4, "lora_alpha": float("nan"), "target_modules": ["q_proj"]}}, "alpha"),
    ({"lora": {"r": 4, "lora_alpha": 8.0, "target_modules": ["../x"]}}, "module names"),
    ({"lora": "rank 4"}, "mapping"),
])
def test_a_malformed_lora_entry_is_refused(changes, match):
    with pytest.raises(WeightLoadError, match=match):
        parse_adapter(adapter_message(**changes), BASE_SHAPES)


def test_adapter_tensors_that_do_not_fit_the_base_model_are_refused():
    good = adapter_message()
    assert parse_adapter(good, BASE_SHAPES).alpha == 8.0
    shapes = list(good.shapes)
    shapes[0] = (4, 65)
    with pytest.raises(WeightLoadError, match="shape"):
        parse_adapter(dataclasses.replace(good, shapes=tuple(shapes)), BASE_SHAPES)
    with pytest.raises(WeightLoadError, match="missing"):  # a layer left out would keep an older update
        parse_adapter(dataclasses.replace(good, names=good.names[1:], shapes=good.shapes[1:]), BASE_SHAPES)
    names = list(good.names)
    names[0] = "base_model.model.model.embed_tokens.lora_A.weight"
    with pytest.raises(WeightLoadError, match="adapts no target layer"):
        parse_adapter(dataclasses.replace(good, names=tuple(names)), BASE_SHAPES)
    names[0] = "model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(WeightLoadError, match="not named as PEFT"):
        parse_adapter(dataclasses.replace(good, names=tuple(names)), BASE_SHAPES)
    with pytest.raises(WeightLoadError, match="max_lora_rank"):
        parse_adapter(good, BASE_SHAPES, max_rank=1)
    assert vllm_max_lora_rank(4) == 8 and vllm_max_lora_rank(8) == 8 and vllm_max_lora_rank(33) == 64


def fake_staged(version: int, b_seed: int, publisher: str = "life-1"):
    model = lora_model(b_seed)
    outgoing = outgoing_version(model, ParallelState(), SETTINGS, "float32", 1 << 20)
    tensors = list(outgoing.weights)
    message = announced(version, [(name, "float32", tuple(t.shape)) for name, t in tensors], outgoing.extra,
                        publisher)
    return SimpleNamespace(version=version, announcement=message,
                           buckets=SimpleNamespace(tensors=lambda: iter(tensors)))


class FakeVllm:
    """add_lora / remove_lora as vLLM's AsyncLLM answers them: True, or False for a refused adapter."""

    def __init__(self):
        self.loaded, self.refuse = {}, False

    async def add(self, request):
        if self.refuse:
            return False
        assert os.path.isfile(os.path.join(request.path, "adapter_model.safetensors"))
        self.loaded[request.lora_id] = request
        return True

    async def remove(self, lora_id):
        self.loaded.pop(lora_id)
        return True


def test_served_adapters_keep_every_admitted_version_and_those_still_in_use(tmp_path):
    fake = FakeVllm()
    adapters = ServedAdapters(fake.add, fake.remove, lambda name, lora_id, path: SimpleNamespace(
        name=name, lora_id=lora_id, path=path), "base", BASE_SHAPES, max_rank=8, keep=2, root=str(tmp_path / "a"))

    async def scenario():
        first = await adapters.load(fake_staged(1, 1))
        with safe_open(os.path.join(first.path, "adapter_model.safetensors"), framework="pt") as handle:
            assert set(handle.keys()) == set(fake_staged(1, 1).announcement.names)
        await adapters.load(fake_staged(2, 2))
        running = adapters.acquire()  # a request that started on v2
        assert running.version == 2
        await adapters.load(fake_staged(3, 3))
        await adapters.load(fake_staged(4, 4))
        assert [s.version for s in adapters.loaded] == [2, 3, 4]  # v2 outlives the window while it runs
        assert not os.path.exists(first.path) and first.lora_id not in fake.loaded
        await adapters.release(running)
        assert [s.version for s in adapters.loaded] == [3, 4] and len(fake.loaded) == 2
        again = await adapters.load(fake_staged(3, 3))  # an evaluation pinned to v3: the loaded adapter again
        assert again.lora_id == 3 and adapters.current.version == 3 and len(fake.loaded) == 2
        fake.refuse = True
        with pytest.raises(WeightLoadError, match="could not add v5"):
            await adapters.load(fake_staged(5, 5))
        assert adapters.current.version == 3 and sorted(os.listdir(adapters.root)) == ["v3-3", "v4-4"]
        fake.refuse = False
        restarted = await adapters.load(fake_staged(3, 9, publisher="life-2"))
        assert restarted.lora_id != 3  # a restarted learner's v3 has other bytes: an adapter of its own

    asyncio.run(scenario())
    adapters.close()
    assert not os.path.exists(adapters.root)


def test_a_written_adapter_directory_is_what_peft_loads(tmp_path):
    from peft import PeftModel

    staged = fake_staged(1, 1)
    spec = parse_adapter(staged.announcement, BASE_SHAPES)
    path = write_adapter_dir(str(tmp_path / "v1"), staged, spec, "base")
    served = PeftModel.from_pretrained(tiny(), path).eval()
    ids = torch.randint(2, VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=ids).logits, lora_model(1)(input_ids=ids).logits, atol=1e-5,
                                   rtol=0)


def test_a_lora_checkpoint_resumes_the_adapter_and_exports_merged(tmp_path, model_dir):
    from peft import PeftModel

    model = apply_lora(tiny(), SETTINGS)
    optimizer, scheduler = build_optimizer(model, LearnerConfig(lr=1e-2, warmup_steps=0))
    ids = torch.randint(2, VOCAB, (2, 10))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    root = str(tmp_path / "ckpt")
    path = save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=2), keep_last=1,
                           model_dir=model_dir)
    resumed = apply_lora(tiny(), SETTINGS)
    resumed_optimizer, resumed_scheduler = build_optimizer(resumed, LearnerConfig(lr=1e-2, warmup_steps=0))
    assert load_checkpoint(path, resumed, resumed_optimizer, resumed_scheduler).version == 2
    for name, tensor in adapter_state(model).items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, atol=0, rtol=0)
    moments = [state["exp_avg"] for state in optimizer.state.values()]
    assert len(resumed_optimizer.state) == len(moments)
    for got, want in zip([s["exp_avg"] for s in resumed_optimizer.state.values()], moments):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    full = tiny()
    with pytest.raises(CheckpointError, match="rank-4 LoRA adapter"):
        load_checkpoint(path, full, *build_optimizer(full, LearnerConfig()))

    out, adapter_dir = str(tmp_path / "merged"), str(tmp_path / "adapter")
    assert cli_main(["export", "--checkpoint", root, "--out", out, "--adapter-out", adapter_dir]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name or "base_layer" in name for name in merged.state_dict())
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
        served = PeftModel.from_pretrained(tiny(), adapter_dir).eval()
        torch.testing.assert_close(served(input_ids=ids).logits, expected, atol=1e-5, rtol=0)


def test_a_checkpoint_without_lora_has_no_adapter_to_export(tmp_path, model_dir):
    model = tiny()
    optimizer, scheduler = build_optimizer(model, LearnerConfig())
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=1), keep_last=1, model_dir=model_dir)
    with pytest.raises(CheckpointError, match="no adapter"):
        export_checkpoint(root, str(tmp_path / "out"), adapter_dir=str(tmp_path / "adapter"))
    assert cli_main(["export", "--checkpoint", root, "--out", str(tmp_path / "out"), "--adapter-out",
                     str(tmp_path / "adapter")]) == 2
    lora = apply_lora(tiny(), SETTINGS)
    with pytest.raises(CheckpointError, match="full weights"):
        load_checkpoint(root + "/step-00000001", lora, *build_optimizer(lora, LearnerConfig()))


def test_lora_settings_and_the_engines_that_serve_them_are_checked():
    from asyncrl.configs import load_config

    with pytest.raises(ValueError, match="rank"):
        LoraSettings(rank=-1)
    with pytest.raises(ValueError, match="LM head"):
        LoraSettings(rank=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="dropout"):
        LoraSettings(rank=4, dropout=1.0)
    with pytest.raises(ValueError, match="SGLang"):
        load_config(None, ["learner.lora.rank=8", "generator.engine=sglang"])
    with pytest.raises(ValueError, match="engine_push"):
        load_config(None, ["learner.lora.rank=8", "generator.engine=vllm", "weightsync.backend=engine_push"])
    with pytest.raises(ValueError, match="do not fit"):
        apply_lora(tiny(), LoraSettings(rank=4, target_modules=["no_such_proj"]))
    assert load_config(None, ["learner.lora.rank=8"]).learner.lora.enabled


def test_the_generators_vllm_engine_takes_the_learners_lora_rank():
    from asyncrl.configs import load_config
    from asyncrl.generator.engines.base import VllmOptions
    from asyncrl.generator.engines.factory import engine_options

    def lora_of(cfg, lora_rank, max_staleness):
        options = engine_options(cfg.generator, cfg.model, "/m", 0, lora_rank, max_staleness).vllm
        return options.lora_rank, options.max_loras

    vllm = load_config(None, ["generator.engine=vllm", "buffer.max_staleness=2"])
    assert lora_of(vllm, 16, vllm.buffer.max_staleness) == (16, 3)
    assert lora_of(vllm, 0, 2) == (0, 1)  # a learner without LoRA announces none
    hf = load_config(None, [])
    assert engine_options(hf.generator, hf.model, "/m", 0, 16, 2).vllm == VllmOptions()  # hf injects on the first
    with pytest.raises(ValueError, match="LoRA rank"):
        lora_of(vllm, "16; rm -rf /", 2)
