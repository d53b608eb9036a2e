"""Helpers shared by the GPU tests: the prompt they sample and the learner's logprobs of a completion, to compare
with an engine's within bf16's tolerance."""
import numpy as np
import torch


PROMPT = [4, 6, 8, 2, 10, 11]


BF16_TOLERANCE = 0.05  # logprobs of two bf16 implementations of the same model differ by a few 1e-2


def learner_logprobs(model, completion) -> np.ndarray:
    from asyncrl.learner.logprobs import compute_logprobs

    ids = torch.tensor([PROMPT + completion], device="cuda")
    logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([0.7], device="cuda"), 64)
    return logprobs[0, len(PROMPT) - 1:].float().cpu().numpy()
