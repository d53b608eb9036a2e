"""Helpers shared by the GPU tests: the prompt they sample, the learner's logprobs of a completion, to compare
with an engine's within bf16's tolerance, a vLLM engine on CUDA with the weight path beside it, and a new version of
a model to load into it."""
import asyncio
import contextlib

import numpy as np
import torch


PROMPT = [4, 6, 8, 2, 10, 11]


BF16_TOLERANCE = 0.05  # logprobs of two bf16 implementations of the same model differ by a few 1e-2


def learner_logprobs(model, completion) -> np.ndarray:
    from asyncrl.learner.logprobs import compute_logprobs

    ids = torch.tensor([PROMPT + completion], device="cuda")
    logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([0.7], device="cuda"), 64)
    return logprobs[0, len(PROMPT) - 1:].float().cpu().numpy()


def perturbed_version(model, publisher, stage, version: int):
    """`model`'s weights moved by a seeded 0.05-scale noise (in place), published as `version` in bf16 and staged:
    what an engine then loads (the caller ends the stage's load after it), and which the test's model now computes."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, device="cuda", dtype=param.dtype))
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    specs = [(name, "bfloat16", tuple(tensor.shape)) for name, tensor in state.items()]
    return stage.stage(publisher.publish(iter(state.items()), version, specs))


@contextlib.contextmanager
def cuda_vllm(model_dir: str, max_model_len: int, tmp_path):
    """(a started vLLM engine on CUDA in bf16 with a fifth of the GPU, `run` for its coroutines, a publisher and a
    stage for the versions it loads), all closed at the end."""
    from asyncrl.generator.engines.base import EngineOptions, VllmOptions
    from asyncrl.generator.engines.vllm_engine import VllmEngine
    from asyncrl.weightsync.publisher import WeightPublisher
    from asyncrl.weightsync.receiver import WeightStage

    engine = VllmEngine(EngineOptions(model_dir, dtype="bfloat16", max_model_len=max_model_len, kv_cache_gib=0.25,
                                      seed=0, vllm=VllmOptions(gpu_memory_utilization=0.2)))
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    run(engine.start())
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 2, 1 << 24), WeightStage(str(tmp_path), "cuda")
    try:
        yield engine, run, publisher, stage
    finally:
        run(engine.close())
        loop.close()
        stage.close()
        publisher.close()
