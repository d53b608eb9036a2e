"""How the hf engine forms its batches (pure logic; the real decoding is tests/integration/test_hf_engine.py)."""
import asyncio

import torch

from asyncrl.buffer.group import Sampling
from asyncrl.generator.engines.hf_engine import _Request, left_pad, take_batch

TEMPERED, GREEDY = Sampling(temperature=1.0, max_tokens=8), Sampling(temperature=0.0, max_tokens=8)


def requests(loop, specs):
    return [_Request([1, 2], sampling, n, loop.create_future()) for sampling, n in specs]


def test_a_batch_takes_the_oldest_request_and_later_ones_that_sample_alike_up_to_the_limit():
    loop = asyncio.new_event_loop()
    try:
        pending = requests(loop, [(TEMPERED, 8), (GREEDY, 1), (TEMPERED, 8), (TEMPERED, 8), (TEMPERED, 1)])
        first, greedy, second, third, small = pending
        batch = take_batch(pending, max_seqs=17)
        assert batch == [first, second, small]  # third would make 25 > 17; the greedy one samples differently
        assert pending == [greedy, third]
        assert take_batch(pending, max_seqs=17) == [greedy] and pending == [third]
    finally:
        loop.close()


def test_an_oversized_request_is_still_decoded_and_cancelled_callers_are_dropped():
    loop = asyncio.new_event_loop()
    try:
        pending = requests(loop, [(TEMPERED, 2), (TEMPERED, 40), (TEMPERED, 2)])
        pending[0].future.cancel()
        batch = take_batch(pending, max_seqs=16)
        assert [request.n for request in batch] == [40]  # alone over the limit, but never starved
        assert [request.n for request in pending] == [2]
    finally:
        loop.close()


def test_left_padding_aligns_every_prompt_on_the_right():
    input_ids, mask = left_pad([[5, 6, 7], [8]])
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ((mask.cumsum(-1) - 1).clamp(min=0) * mask).tolist() == [[0, 1, 2], [0, 0, 0]]
    assert torch.equal(input_ids[mask.bool()], torch.tensor([5, 6, 7, 8]))
