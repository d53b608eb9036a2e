"""A random trajectory group, for tests of what the learner does with groups."""
import time

import numpy as np

from asyncrl.buffer.group import Group, Sample, Sampling


def make_group(rng, n=3, version=0, temperature=0.7):
    prompt = rng.integers(2, 32, size=rng.integers(2, 6)).astype(np.int32)
    samples = []
    for _ in range(n):
        length = int(rng.integers(1, 7))
        samples.append(Sample(completion_ids=rng.integers(2, 32, size=length).astype(np.int32),
                              logprobs=-rng.random(length).astype(np.float32) * 3,
                              versions=np.full(length, version, dtype=np.int32),
                              reward=float(rng.integers(0, 2)), finish_reason="stop"))
    return Group(group_id="g", prompt_id="p", generator_id="t", prompt_ids=prompt, samples=samples,
                 sampling=Sampling(temperature=temperature), created_at=time.time())
