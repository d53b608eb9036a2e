"""Model and tokenizer loading for the learner: HF causal LMs from a local directory, never from the hub."""
import logging
import os

import torch

from asyncrl.weightsync.dtypes import DTYPES

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model directory is missing or unreadable."""


def load_model(path: str, dtype: str = "float32", trust_remote_code: bool = False, attn_implementation: str = "sdpa"):
    """A causal model from a local HF directory (`AutoModelForCausalLM`; a vision-language model's
    image-text-to-text class, data/vision.py), in `dtype`, with the given attention ("auto": see
    resolve_attn_implementation)."""
    from transformers import AutoConfig

    from asyncrl.data.vision import auto_model_class

    check_model_dir(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = auto_model_class(config).from_pretrained(
        path, dtype=DTYPES[dtype], attn_implementation=resolve_attn_implementation(attn_implementation, config),
        trust_remote_code=trust_remote_code)
    return model


def resolve_attn_implementation(name: str, config=None) -> str:
    """"auto" is flash-attn 2 on CUDA when it is installed (packed rows then run as varlen, no mask), else sdpa.
    A model that soft-caps its attention logits (Gemma 2's `attn_logit_softcapping`) gets eager attention instead
    of sdpa: sdpa has no soft-capping and HF's sdpa path silently skips it, which vLLM does not."""
    if name == "auto" and torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            name = "flash_attention_2"
        except ImportError:
            pass
    name = "sdpa" if name == "auto" else name
    if name == "sdpa" and getattr(config, "attn_logit_softcapping", None):
        log.info("the model soft-caps its attention logits, which sdpa cannot: eager attention instead")
        return "eager"
    return name


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    check_model_dir(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def check_model_dir(path: str) -> None:
    if path is None:
        raise ModelLoadError("model.path is not set (and demo.task is off): give a local HF model directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model.path {path!r} is not an HF model directory (no config.json)")


def build_qwen2(vocab_size: int, hidden_size: int, num_layers: int, eos_token_id: int, pad_token_id: int, seed: int,
                max_positions: int = 128):
    """A tiny Qwen2 built from a config (no download). head_dim 32 is one vLLM's CPU attention supports."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(1, hidden_size // 32)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


QWEN2_05B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, rms_norm_eps=1e-6)
"""Qwen2-0.5B's published body (its config.json), without its 151936-token vocabulary."""


def build_qwen2_05b(vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int, max_positions: int = 128,
                    dtype: torch.dtype = torch.float32):
    """A randomly initialised model of Qwen2-0.5B's shape (QWEN2_05B_SHAPE, rope theta 1e6, tied embeddings) for
    GPU checks, built from a config (no download) in `dtype`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, max_position_embeddings=max_positions, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         eos_token_id=eos_token_id, bos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         **QWEN2_05B_SHAPE)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype)


def model_positions(model) -> int:
    """The longest sequence the model takes (HF configs name it max_position_embeddings; a model without the
    field sets no bound here)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)
