"""Tiny models of every family through the learner's logprobs: padded and packed both equal the model's own
forward, which needs Gemma 2's final soft-capping in the head, and sliding windows in the packed masks."""
import pytest
import torch

from asyncrl.learner.families import FAMILIES, build_family_model, family_config
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import resolve_attn_implementation


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_and_packed_logprobs_equal_the_models_own_forward(family):
    model = build_family_model(family, 40)
    model.config._experts_implementation = "eager"  # grouped_mm has no fp64; the routing is the same
    model = model.double()
    torch.manual_seed(1)
    ids = torch.randint(2, 40, (2, 20))  # 20 tokens cross the sliding window of 8
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    temps = torch.tensor([1.0, 0.7])
    padded, _ = compute_logprobs(model, ids, mask, temps, 7)
    packed, _ = compute_logprobs(model, ids, mask, temps, 7, packed=True)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, :-1] / temps[:, None, None]
    own = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    valid = mask[:, 1:].bool()
    torch.testing.assert_close(padded[valid], own[valid], atol=1e-10, rtol=0)
    torch.testing.assert_close(packed[valid], own[valid], atol=1e-10, rtol=0)


def test_gemma2s_attention_soft_capping_gets_eager_attention_not_sdpa():
    """HF's sdpa path skips attention soft-capping without a word (vLLM applies it): the learner loads such a model
    with eager attention."""
    gemma = family_config("gemma2", 40)
    assert resolve_attn_implementation("sdpa", gemma) == "eager"
    assert resolve_attn_implementation("sdpa", family_config("mistral", 40)) == "sdpa"
    assert resolve_attn_implementation("eager", gemma) == "eager"
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        family_config("gpt2", 40)
