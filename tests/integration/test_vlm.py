"""A vision-language model (Qwen2.5-VL, the tiny one the vision demo builds) through the hf engine and the learner:
the logprobs the engine samples with on image prompts are the ones the learner recomputes, padded and packed, in a
batch that mixes image rows with a text row; a frozen vision tower stays as it was through a train step while the
text model moves (tests/e2e/test_vlm.py trains the whole loop and evaluates its exported checkpoint)."""
import asyncio

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.data.prompts import load_train_prompts
from asyncrl.data.vision import placeholder_tokens, vision_processor
from asyncrl.generator.engines.base import EngineOptions
from asyncrl.generator.engines.hf_engine import HfEngine
from asyncrl.learner.batch import build_batch
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import load_model

SAMPLING = Sampling(1.0, 1.0, -1, 4)


def sampled_groups(model_dir, rows, n=3):
    """Each row sampled `n` times by the hf engine (one batch: the requests arrive together), as groups."""
    engine = HfEngine(EngineOptions(model_dir, "float32", 128, 0, seed=7))

    async def sample():
        await engine.start()
        return await asyncio.gather(*(engine.sample(row.prompt_ids, SAMPLING, n, **({"images": row.images}
                                                                                    if row.images else {}))
                                      for row in rows))

    groups = []
    for row, completions in zip(rows, asyncio.run(sample())):
        samples = [Sample(np.asarray(c.token_ids, np.int32), np.asarray(c.logprobs, np.float32),
                          np.asarray(c.versions, np.int32), 0.0, c.finish_reason) for c in completions]
        group = Group(f"g{len(groups)}", row.prompt_id, "gen-0", np.asarray(row.prompt_ids, np.int32), samples,
                      SAMPLING, 0.0)
        group.images = row.images
        groups.append(group)
    assert engine.batches == 1
    return groups


def image_rows(model_dir, files, count):
    from asyncrl.configs import load_config

    cfg = load_config(None, ["data.max_prompt_tokens=64"])
    return load_train_prompts(cfg.data, files, model_dir, seed=0).rows[:count]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vision_model(request, vlm_assets, tmp_path_factory):
    """(model dir, train files) of each family: the vision demo's Qwen2.5-VL, and a Qwen3-VL built the same way
    with the demo's tokenizer (16-pixel patches, DeepStack, interleaved M-RoPE)."""
    model_dir, files = vlm_assets
    if request.param == "qwen2_5_vl":
        return vlm_assets
    from transformers import AutoTokenizer

    from asyncrl.learner.init_model import build_vision_model, padded_vocab, save_model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, processor = build_vision_model("qwen3_vl", padded_vocab(len(tokenizer)), tokenizer, seed=0)
    out = str(tmp_path_factory.mktemp("qwen3-vl"))
    save_model_dir(out, model, tokenizer)
    processor.save_pretrained(out)
    return out, files


def test_engine_and_learner_logprobs_agree_on_image_prompts(vision_model):
    model_dir, files = vision_model
    rows = image_rows(model_dir, files, 3)
    assert all(row.images for row in rows)
    text_row = type(rows[0])("text-0", [9, 10, 11], rows[0].data_source, "r", {})  # no image, in the same batch
    groups = sampled_groups(model_dir, [*rows, text_row])
    banned = placeholder_tokens(load_model(model_dir).config)
    for group in groups:  # the engine never samples an image pad (the next forward would take it for an image)
        for sample in group.samples:
            assert not np.isin(sample.completion_ids, banned).any()
    model = load_model(model_dir).eval()
    batch = build_batch(groups, vision_processor(model_dir))
    widened = int(batch.attention_mask[0].sum()) - len(groups[0].samples[0].completion_ids)
    assert widened > len(rows[0].prompt_ids)  # the image pad became the image's patches
    assert batch.images[0] is batch.images[1]  # a group's rows share its processed image
    assert batch.images[-1] is None
    with torch.no_grad():
        for packed in (False, True):
            logprobs, _ = compute_logprobs(model, batch.input_ids, batch.attention_mask, batch.temperatures, 1024,
                                           packed=packed, vision=batch.vision_inputs())
            gap = float(((logprobs - batch.logprobs_behav).abs() * batch.loss_mask).max())
            assert gap < 1e-4, (packed, gap)
        # the image matters: the same rows with another row's image give other logprobs
        swapped = [*groups[:-1], groups[-1]]
        swapped[0] = Group("s", groups[0].prompt_id, "gen-0", groups[0].prompt_ids, groups[0].samples, SAMPLING, 0.0)
        swapped[0].images = groups[1].images
        other = build_batch(swapped, vision_processor(model_dir))
        moved, _ = compute_logprobs(model, other.input_ids, other.attention_mask, other.temperatures, 1024,
                                    vision=other.vision_inputs())
        assert float(((moved - logprobs).abs() * batch.loss_mask)[:3].max()) > 1e-3


@pytest.mark.parametrize("freeze", [True, False])
def test_a_frozen_vision_tower_stays_and_the_text_model_trains(vlm_assets, freeze):
    from asyncrl.configs import load_config
    from asyncrl.learner.build import build_optimizer, build_policy
    from asyncrl.learner.parallel import ParallelState
    from asyncrl.learner.train_step import StepSettings, train_step

    model_dir, files = vlm_assets
    rows = image_rows(model_dir, files, 2)
    groups = sampled_groups(model_dir, rows, n=4)
    for group in groups:  # rewards that differ within each group: advantages that are not 0
        for index, sample in enumerate(group.samples):
            sample.reward = float(index % 2)
    cfg = load_config(None, [f"learner.freeze_vision={str(freeze).lower()}", "learner.lr=1e-2",
                             "learner.warmup_steps=0"])
    model = build_policy(cfg.learner, False, model_dir, ParallelState()).train()
    optimizer, scheduler = build_optimizer(model, cfg.learner)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    settings = StepSettings(version=0, max_staleness=1, max_tokens_per_microbatch=4096, chunk_tokens=1024,
                            grad_clip=1.0, vision=vision_processor(model_dir))
    result = train_step(model, optimizer, scheduler, groups, cfg.algo, settings)
    assert result.moved
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    vision = {name for name in before if ".visual." in f".{name}"}
    assert vision and any("language_model" in name for name in changed)
    assert (changed & vision == set()) if freeze else (changed & vision)


def test_a_published_version_has_the_files_names_for_vllm(vlm_assets):
    """vLLM checks each version against the model's files: the learner's in-memory names
    (`model.language_model.*`, `model.visual.*`) go back to the files' (`model.*`, `visual.*`)."""
    from safetensors import safe_open

    from asyncrl.generator.engines.checkpoint_layout import CheckpointLayout
    from asyncrl.generator.engines.vllm_engine import check_against_checkpoint, checkpoint_shapes

    model_dir, _ = vlm_assets
    state = load_model(model_dir).state_dict()
    assert any(name.startswith("model.language_model.") for name in state)
    layout = CheckpointLayout.for_model_dir(model_dir)
    converted = dict(layout.convert(state.items()))
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as handle:
        files = {name: handle.get_tensor(name) for name in handle.keys()}
    assert set(converted) == set(files)
    for name, tensor in files.items():
        torch.testing.assert_close(converted[name], tensor, atol=0, rtol=0, msg=name)
    shapes = layout.shapes(list(state), [tuple(t.shape) for t in state.values()])
    assert check_against_checkpoint(shapes, checkpoint_shapes(model_dir)) == []


def test_vllm_is_given_the_rows_images_and_never_samples_a_placeholder(vlm_assets):
    """What the vLLM engine sends (the GPU runs it: tests/gpu/test_vllm_vlm.py): the prompt with one pad per image
    and the decoded images as `multi_modal_data`, the placeholders at vLLM's lowest logit bias; on CPU it refuses
    at start, saying why and what to use."""
    pytest.importorskip("vllm")
    from asyncrl.generator.engines.base import EngineUnsupported
    from asyncrl.generator.engines.vllm_engine import VllmEngine, prompt_input, request_params

    model_dir, files = vlm_assets
    row = image_rows(model_dir, files, 1)[0]
    prompt = prompt_input(row.prompt_ids, row.images)
    assert prompt["prompt_token_ids"] == row.prompt_ids
    assert [image.size for image in prompt["multi_modal_data"]["image"]] == [(56, 56)]
    assert "multi_modal_data" not in prompt_input(row.prompt_ids, None)
    banned = placeholder_tokens(load_model(model_dir).config)
    params = request_params(SAMPLING, 4, 2, 1, banned)
    assert params.logit_bias == {token: -100.0 for token in banned}
    assert not request_params(SAMPLING, 4, 2, 1).logit_bias
    if not torch.cuda.is_available():
        with pytest.raises(EngineUnsupported, match="torchvision"):
            asyncio.run(VllmEngine(EngineOptions(model_dir, "float32", 128, 0.25, 0)).start())
