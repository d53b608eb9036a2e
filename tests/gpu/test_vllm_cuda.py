"""vLLM on CUDA with asyncrl's weight path: the engine started with the GPU settings (CUDA graphs on, a share of
the GPU's memory), samples whose logprobs are the learner's, and a version loaded through the generator's staging
and vLLM's weight-transfer API (`asyncrl_shm`), after which the logprobs are the new weights' and every token is
tagged with the new version. Needs CUDA and the `gpu` extra's vLLM; scripts/test_gpu runs it."""

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling
from tests.gpu.helpers import BF16_TOLERANCE, PROMPT, cuda_vllm, learner_logprobs, perturbed_version

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def worst_gap(model, completions) -> float:
    with torch.no_grad():
        return max(float(np.max(np.abs(learner_logprobs(model, c.token_ids) - np.array(c.logprobs))))
                   for c in completions)


def test_vllm_on_cuda_samples_the_learners_distribution_and_takes_a_staged_version(demo_assets, tmp_path):
    pytest.importorskip("vllm")
    from asyncrl.learner.model import load_model

    with cuda_vllm(demo_assets[0], 64, tmp_path) as (engine, run, publisher, stage):
        sampling = Sampling(temperature=0.7, max_tokens=8)
        model = load_model(demo_assets[0]).to("cuda", torch.bfloat16).eval()
        assert worst_gap(model, run(engine.sample(PROMPT, sampling, n=4))) < BF16_TOLERANCE
        staged = perturbed_version(model, publisher, stage, 3)
        run(engine.load_weights(staged))
        stage.end_load(staged, ok=True)
        after = run(engine.sample(PROMPT, sampling, n=4))
        assert all(set(c.versions) == {3} for c in after)
        assert worst_gap(model, after) < BF16_TOLERANCE  # the new weights' distribution, prefix cache included
