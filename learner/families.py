"""Tiny models of the families a verl user brings, built from their transformers configs (no hub, no download).

Each keeps what makes its family different, at a size a 2-core machine trains in seconds: Qwen3's q/k norms,
Llama 3's rope scaling, Mistral's sliding window, Gemma 2's logit soft-capping (attention and final), alternating
sliding / full layers and embedding scale, Qwen3-MoE's routed experts, DeepSeek-V3's latent attention (MLA) and
sigmoid group-limited routing with a shared expert. The tests run each one through the learner
(FSDP2, Ulysses), vLLM and export (tests/unit/test_families.py, tests/integration/test_parallel.py and
tests/integration/test_families_vllm.py). head_dim 32 is one vLLM's CPU attention supports.
"""
import torch

FAMILIES = ("qwen2", "qwen3", "llama3", "mistral", "gemma2", "qwen3_moe", "deepseek_v3")


def family_config(family: str, vocab_size: int, hidden_size: int = 64, num_layers: int = 2, heads: int = 4,
                  kv_heads: int = 2, max_positions: int = 128, sliding_window: int = 8):
    """The transformers config of a tiny `family` model. `sliding_window` is small so that short test sequences
    cross it (a window longer than every sequence would hide a model that ignores it)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  head_dim=hidden_size // heads, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    if family == "qwen2":
        return transformers.Qwen2Config(intermediate_size=2 * hidden_size, tie_word_embeddings=True, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=2 * hidden_size, tie_word_embeddings=True, **common)
    if family == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": max_positions // 2, "rope_theta": 500000.0}
        return transformers.LlamaConfig(intermediate_size=2 * hidden_size, tie_word_embeddings=False,
                                        rope_parameters=rope, **common)
    if family == "mistral":
        return transformers.MistralConfig(intermediate_size=2 * hidden_size, sliding_window=sliding_window,
                                          tie_word_embeddings=False, **common)
    if family == "gemma2":
        return transformers.Gemma2Config(intermediate_size=2 * hidden_size, sliding_window=sliding_window,
                                         query_pre_attn_scalar=hidden_size // heads, attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 2,
                                           num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True, **common)
    if family == "deepseek_v3":
        # MLA: the latent KV (kv_lora_rank) and the decoupled rope part are the shape of vLLM's one CPU MLA decode
        # kernel (512 + 64 = 576); the nope and value heads are free. The MoE routes as DeepSeek-V3 does: sigmoid
        # scores, the bias-corrected group-limited top-k (`noaux_tc`), a shared expert, the first layer dense.
        # topk_method and scoring_func are not transformers config fields (its V3 router always does this), but
        # vLLM reads them and would otherwise route with a softmax.
        return transformers.DeepseekV3Config(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            moe_intermediate_size=hidden_size // 2, num_hidden_layers=num_layers, num_attention_heads=heads,
            num_key_value_heads=heads, max_position_embeddings=max_positions, kv_lora_rank=512, q_lora_rank=None,
            qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_group=2, topk_group=1,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid", tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=1, pad_token_id=0)
    raise ValueError(f"unknown model family {family!r}; known: {FAMILIES}")


def build_family_model(family: str, vocab_size: int, seed: int = 0, **shape):
    """A randomly initialised tiny `family` model (AutoModelForCausalLM), fp32, with the attention the learner
    would load it with (sdpa, or eager for Gemma 2's soft-capping: model.py::resolve_attn_implementation)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.model import resolve_attn_implementation

    config = family_config(family, vocab_size, **shape)
    config._attn_implementation = resolve_attn_implementation("sdpa", config)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)
