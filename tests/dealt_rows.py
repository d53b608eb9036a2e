"""A prompt row as the learner's dealer reads it from the dataset, for tests that deal prompts; a dealer over a few
of them on a clock the test moves, the group a generator sends back for a deal, and an admit reply with its deals
decoded as a generator's admission gate hands them out."""
import dataclasses
import time

import numpy as np

from asyncrl.buffer.dealing import PromptDealer
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.data.prompts import PromptRow, decode_prompt, encode_prompts


def Row(prompt_id: str, prompt_ids: list, data_source="openai/gsm8k", ground_truth="4", extra_info=None,
        messages=None) -> PromptRow:
    return PromptRow(prompt_id, prompt_ids, data_source, ground_truth, extra_info or {}, messages)


def rows(count):
    return [Row(f"f.parquet:{i}", [3, 4 + i % 5], extra_info={"index": i},
                messages=[{"role": "user", "content": f"q{i}"}]) for i in range(count)]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def dealer(count=6, epochs=1, timeout_s=60.0, clock=None, shuffle=True):
    return PromptDealer(encode_prompts(rows(count)), shuffle=shuffle, seed=7, epochs=epochs, timeout_s=timeout_s,
                        clock=clock or Clock())


def group_for(deal, gen="gen-a", reward=1.0):
    sample = Sample(completion_ids=np.array([3, 4], np.int32), logprobs=np.array([-0.5, -1.0], np.float32),
                    versions=np.array([0, 0], np.int32), reward=reward, finish_reason="stop")
    return Group(group_id=f"g-{deal.deal_id}", prompt_id=deal.prompt_id, generator_id=gen,
                 prompt_ids=np.asarray(deal.prompt_ids, np.int32), samples=[sample], sampling=Sampling(1.0),
                 created_at=time.time(), meta={"data_source": deal.data_source, "deal": deal.deal_id})


def decoded(reply):
    """The admit reply with its deals decoded, as the generator's admission gate hands them out."""
    return dataclasses.replace(reply, deals=[decode_prompt(*deal) for deal in reply.deals])
