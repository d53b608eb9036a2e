"""vLLM on CUDA with a vision-language model (the vision demo's tiny Qwen2.5-VL): image prompts sampled with the
row's images as `multi_modal_data`, the learner's logprobs of them on the same images within bf16's tolerance,
placeholders never sampled, and a version loaded through the generator's staging (its names converted to the
files' by checkpoint_layout.py), after which the logprobs are the new weights'. Needs CUDA and the `gpu` extra's
vLLM (and its torchvision); scripts/test_gpu runs it. On CPU vLLM refuses the model at start
(tests/integration/test_vlm.py)."""
import asyncio

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Group, Sample, Sampling
from tests.gpu.helpers import BF16_TOLERANCE, cuda_vllm, perturbed_version

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SAMPLING = Sampling(temperature=1.0, max_tokens=4)


def worst_gap(model, vision, rows, completions) -> float:
    from asyncrl.learner.batch import build_batch
    from asyncrl.learner.logprobs import compute_logprobs

    groups = []
    for row, sampled in zip(rows, completions):
        samples = [Sample(np.asarray(c.token_ids, np.int32), np.asarray(c.logprobs, np.float32),
                          np.asarray(c.versions, np.int32), 0.0, c.finish_reason) for c in sampled]
        group = Group("g", row.prompt_id, "gen", np.asarray(row.prompt_ids, np.int32), samples, SAMPLING, 0.0)
        group.images = row.images
        groups.append(group)
    batch = build_batch(groups, vision).to("cuda")
    with torch.no_grad():
        logprobs, _ = compute_logprobs(model, batch.input_ids, batch.attention_mask, batch.temperatures, 1024,
                                       vision=batch.vision_inputs())
    return float(((logprobs.float() - batch.logprobs_behav).abs() * batch.loss_mask).max())


def test_vllm_on_cuda_samples_image_prompts_as_the_learner_computes_them(vlm_assets, tmp_path):
    pytest.importorskip("vllm")
    from asyncrl.configs import load_config
    from asyncrl.data.prompts import load_train_prompts
    from asyncrl.data.vision import placeholder_tokens, vision_processor
    from asyncrl.learner.model import load_model

    model_dir, files = vlm_assets
    rows = load_train_prompts(load_config(None, []).data, files, model_dir, seed=0).rows[:4]
    with cuda_vllm(model_dir, 128, tmp_path) as (engine, run, publisher, stage):
        model = load_model(model_dir).to("cuda", torch.bfloat16).eval()
        vision = vision_processor(model_dir)

        def sample():
            return run(asyncio.gather(*(engine.sample(row.prompt_ids, SAMPLING, 4, images=row.images)
                                        for row in rows)))

        first = sample()
        banned = placeholder_tokens(model.config)
        assert not any(np.isin(c.token_ids, banned).any() for sampled in first for c in sampled)
        assert worst_gap(model, vision, rows, first) < BF16_TOLERANCE
        staged = perturbed_version(model, publisher, stage, 3)
        run(engine.load_weights(staged))
        stage.end_load(staged, ok=True)
        after = sample()
        assert all(set(c.versions) == {3} for sampled in after for c in sampled)
        assert worst_gap(model, vision, rows, after) < BF16_TOLERANCE
