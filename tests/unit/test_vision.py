"""The vision-language pieces that need no model (data/vision.py and where it is used): placeholder tokens never
sampled and refused on the wire, a batch's images sliced with its rows, a group's images from the learner's own
rows only, and the settings a vision-language model refuses, each with its reason."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.buffer.codec import decode_group, encode_group
from asyncrl.buffer.plausibility import JobLimits
from asyncrl.configs import load_config
from asyncrl.data.vision import (SUPPRESSED_LOGIT, VisionError, VisionInputs, is_vision_dir, placeholder_tokens,
                                 suppress)
from asyncrl.learner.batch import Batch
from asyncrl.learner.build import refuse_for_vision, refuse_vision_job
from asyncrl.learner.loop import attach_images
from asyncrl.learner.parallel import ParallelState
from asyncrl.buffer.group import Group, Sample, Sampling

def make_sample(completion_ids=(5, 6, 7)) -> Sample:
    ids = np.asarray(completion_ids, np.int32)
    return Sample(ids, np.full(len(ids), -0.5, np.float32), np.full(len(ids), 2, np.int32), 1.0, "stop")


def make_group(prompt_id="p", samples=None) -> Group:
    return Group("g", prompt_id, "gen-0", np.arange(1, 5, dtype=np.int32), samples or [make_sample(), make_sample()],
                 Sampling(1.0, 0.9, 50, 64), 0.0)


CONFIG = SimpleNamespace(image_token_id=6, video_token_id=7, vision_start_token_id=4, vision_end_token_id=5)


def test_placeholders_are_never_sampled_yet_keep_a_finite_logprob_as_targets():
    assert placeholder_tokens(CONFIG) == (4, 5, 6, 7)
    logits = torch.zeros(2, 10, requires_grad=True)
    log_probs = suppress(logits, (4, 5, 6, 7)).log_softmax(-1)
    assert float(log_probs[:, 4:8].detach().exp().sum()) == 0.0  # never sampled
    assert torch.isfinite(log_probs).all()  # a prompt's image pad as a target: finite, masked out, no nan
    assert torch.allclose(log_probs[:, 0].exp(), torch.full((2,), 1 / 6))
    log_probs[:, 0].sum().backward()  # out of place: autograd flows to the other logits
    assert logits.grad[:, 4:8].abs().max() == 0 and logits.grad[:, 0].abs().min() > 0
    assert SUPPRESSED_LOGIT < -1000


def test_a_completion_holding_a_placeholder_is_refused_on_arrival():
    limits = JobLimits(group_size=2, temperature=1.0, top_p=0.9, top_k=50, max_tokens=64, max_completion_tokens=64,
                       max_prompt_tokens=8, max_positions=70, forbidden_tokens=(6, 7))
    wire = dict(vocab_size=1000, max_version=10, max_message_bytes=1 << 20, limits=limits)
    assert decode_group(encode_group(make_group(samples=[make_sample((8, 9)), make_sample((5,))])), **wire)
    hostile = make_group(samples=[make_sample((9, 6, 9)), make_sample((5,))])
    with pytest.raises(Exception) as refused:
        decode_group(encode_group(hostile), **wire)
    assert refused.value.reason == "token_out_of_range" and "vision placeholder" in str(refused.value)


def test_a_batchs_images_follow_its_rows_and_concatenate_in_row_order():
    first = VisionInputs(torch.ones(4, 3), torch.tensor([[1, 2, 2]]))
    second = VisionInputs(torch.full((8, 3), 2.0), torch.tensor([[1, 2, 4]]))
    rows = 4
    batch = Batch(input_ids=torch.ones(rows, 5, dtype=torch.long), attention_mask=torch.ones(rows, 5, dtype=torch.long),
                  loss_mask=torch.ones(rows, 4), logprobs_behav=torch.zeros(rows, 4),
                  versions=torch.zeros(rows, 4, dtype=torch.long), token_rewards=torch.zeros(rows, 4),
                  temperatures=torch.ones(rows), rows=torch.arange(rows), images=[first, first, None, second])
    inputs = batch.vision_inputs()
    assert inputs.pixel_values.shape == (16, 3) and inputs.image_grid_thw.tolist() == [[1, 2, 2]] * 2 + [[1, 2, 4]]
    micro = batch.select(torch.tensor([3, 2]))
    assert micro.images == [second, None] and micro.vision_inputs().image_grid_thw.tolist() == [[1, 2, 4]]
    assert batch.select(torch.tensor([2])).vision_inputs() is None


def test_groups_get_images_from_the_learners_rows_by_prompt_id_only():
    groups = [make_group(prompt_id="p1"), make_group(prompt_id="p2")]
    attach_images(groups, {"p1": [b"png"]})
    assert groups[0].images == [b"png"] and groups[1].images is None
    assert b"png" not in encode_group(groups[0])  # never on the wire


def test_what_a_vision_language_model_refuses_is_said_before_anything_is_built(tmp_path):
    learner = load_config(None, []).learner
    with pytest.raises(VisionError, match="sp_size > 1"):
        refuse_for_vision(learner, SimpleNamespace(sp_size=2))
    with pytest.raises(VisionError, match="learner.lora"):
        refuse_for_vision(load_config(None, ["learner.lora.rank=4"]).learner, ParallelState())
    with pytest.raises(VisionError, match="moe_routing_replay"):
        refuse_for_vision(load_config(None, ["learner.moe_routing_replay=true"]).learner, ParallelState())
    refuse_for_vision(learner, ParallelState())
    with pytest.raises(VisionError, match="rows the learner deals"):
        refuse_vision_job(load_config(None, []), deals=False)
    with pytest.raises(VisionError, match="critic"):
        refuse_vision_job(load_config(None, ["algo.advantage=gae"]), deals=True)
    refuse_vision_job(load_config(None, []), deals=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    assert is_vision_dir(str(tmp_path)) and not is_vision_dir(str(tmp_path / "missing"))
    from asyncrl.generator.engines.base import EngineOptions
    from asyncrl.generator.engines.factory import make_engine

    with pytest.raises(RuntimeError, match="SGLang engine does not take images"):
        make_engine("sglang", EngineOptions(str(tmp_path), "float32", 128, 0, 0))
