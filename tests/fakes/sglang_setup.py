"""asyncrl's SglangEngine on the fake SGLang engine (tests/fakes/fake_sglang.py), with weights whose lengths are
deterministic."""
import torch

from asyncrl.generator.engines.base import EngineOptions, SglangOptions
from asyncrl.generator.engines.sglang_engine import SglangEngine
from tests.fakes.fake_sglang import EOS, FakeSglangEngine, initial_weights, write_checkpoint


def weights_without_eos(seed: int) -> dict:
    """Weights whose EOS logit is always -100, so requests run to max_tokens (deterministic lengths)."""
    weights = initial_weights(seed)
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["lm_head.weight"][EOS] = torch.tensor([-100.0] + [0.0] * 7)
    return weights


def build(tmp_path, update_mode: str = "wait", timeout_s: float = 2.0, drain_timeout_s: float = 2.0,
          **server_args) -> tuple:
    """(engine, model_dir): an SglangEngine on the fake, v0 = the checkpoint in model_dir."""
    from transformers import Qwen2Config

    model_dir = str(tmp_path / "model")
    Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(model_dir)
    write_checkpoint(model_dir, weights_without_eos(0))
    engine = SglangEngine(EngineOptions(model_dir, "float32", max_model_len=64, kv_cache_gib=0.001, seed=0,
                                        update_mode=update_mode, sglang=SglangOptions(
                                            engine_factory=FakeSglangEngine, timeout_s=timeout_s,
                                            drain_timeout_s=drain_timeout_s, server_args=server_args)))
    return engine, model_dir
