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


def test_engine_and_learner_logprobs_agree_on_image_prompts(vlm_assets):
    model_dir, files = vlm_assets
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
