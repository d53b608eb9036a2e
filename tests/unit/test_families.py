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


def test_the_gpu_checks_model_has_qwen2_05b_published_body():
    """demo.model_shape=qwen2-0.5b (scripts/test_gpu): Qwen2-0.5B's layers, widths and heads, built on the meta
    device here (no memory); with its 151936-token vocabulary it would count Qwen2-0.5B's 494M parameters."""
    from asyncrl.learner.model import build_qwen2_05b

    with torch.device("meta"):
        model = build_qwen2_05b(151936, eos_token_id=1, pad_token_id=0, seed=0)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size) == (24, 896, 14, 2, 4864)
    assert model.model.layers[0].self_attn.head_dim == 64
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 1e6
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - 494) < 1
