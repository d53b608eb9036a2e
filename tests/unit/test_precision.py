"""learner.autocast (learner/precision.py): bf16 autocast over fp32 weights, with attention kept in fp32 on CPU."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncrl.algos.config import AlgoConfig
from asyncrl.learner.build import shard_model
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.logprobs import Fp32Head
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.parallel import ParallelState
from asyncrl.learner.precision import (CPU_SDPA, cpu_has_native_bf16, in_fp32, resolve_autocast,
                                       wants_fp32_attention)
from asyncrl.learner.sequence_attention import inner_attention
from asyncrl.learner.train_step import StepSettings, train_step
from tests.groups import make_group


def tiny_model():
    return build_qwen2(vocab_size=32, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0, seed=0).train()


def test_config_takes_bfloat16_auto_or_off_and_refuses_the_rest():
    assert LearnerConfig(autocast="bfloat16").autocast == "bfloat16"
    assert LearnerConfig(autocast="auto").autocast == "auto"
    assert LearnerConfig().autocast == ""
    for bad in ("float16", "bf16", "fp32"):
        with pytest.raises(ValueError, match="learner.autocast"):
            LearnerConfig(autocast=bad)


def test_auto_is_bf16_where_the_cpu_has_native_bf16_and_explicit_values_pass_through():
    native = cpu_has_native_bf16()
    with open("/proc/cpuinfo") as handle:
        assert native == any(flag in handle.read().split() for flag in ("avx512_bf16", "amx_bf16"))
    assert resolve_autocast("auto", "cpu") == ("bfloat16" if native else "")
    assert wants_fp32_attention("cpu", "float32", "auto") == native
    assert resolve_autocast("bfloat16", "cpu") == "bfloat16" and resolve_autocast("", "cpu") == ""


def test_fp32_attention_is_chosen_on_cpu_for_low_precision_only():
    assert wants_fp32_attention("cpu", "float32", "bfloat16")
    assert wants_fp32_attention("cpu", "bfloat16", "")
    assert not wants_fp32_attention("cpu", "float32", "")
    assert not wants_fp32_attention("cuda:0", "float32", "bfloat16")
    model = shard_model(tiny_model(), LearnerConfig(autocast="bfloat16"), ParallelState())
    assert model.config._attn_implementation == CPU_SDPA
    assert shard_model(tiny_model(), LearnerConfig(), ParallelState()).config._attn_implementation == "sdpa"


def test_in_fp32_computes_in_fp32_and_returns_the_inputs_dtype():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, dtype=torch.bfloat16) for _ in range(3))
    seen = []

    def attention(q, k, v):
        seen.append((q.dtype, torch.is_autocast_enabled("cpu")))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = in_fp32(attention, q, k, v)
    assert seen == [(torch.float32, False)] and out.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_ulysses_inner_attention_upcasts_on_cpu():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 12, 8, dtype=torch.bfloat16) for _ in range(3))
    segments = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    out = inner_attention(q, k, v, segments, None, 0.0)
    expected = inner_attention(q.float(), k.float(), v.float(), segments, None, 0.0).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_fp32_head_stays_fp32_under_autocast():
    head = torch.nn.Linear(16, 32, bias=False)
    hidden = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head(hidden).dtype == torch.bfloat16
        logits = Fp32Head(head)(hidden)
    assert logits.dtype == torch.float32 and torch.equal(logits, head(hidden))


def step(model, groups, autocast: str, packing: bool = False):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    settings = StepSettings(version=1, max_staleness=1, max_tokens_per_microbatch=64, chunk_tokens=7, grad_clip=1.0,
                            autocast=autocast, packing=packing)
    return train_step(model, optimizer, scheduler, groups, AlgoConfig(loss="ppo", correction="decoupled",
                                                                      prox_logprobs="loglinear"), settings)


@pytest.mark.parametrize("packing", [False, True])
def test_an_autocast_step_matches_fp32_closely_and_keeps_fp32_weights(packing):
    rng = np.random.default_rng(3)
    groups = [make_group(rng, n=4) for _ in range(3)]
    fp32 = shard_model(tiny_model(), LearnerConfig(), ParallelState())
    bf16 = shard_model(copy.deepcopy(fp32), LearnerConfig(autocast="bfloat16"), ParallelState())
    assert bf16.config._attn_implementation == CPU_SDPA
    before = {name: param.detach().clone() for name, param in bf16.named_parameters()}
    want, got = step(fp32, groups, "", packing), step(bf16, groups, "bfloat16", packing)
    assert got.moved and want.moved
    for key in ("loss/pg", "policy/entropy", "policy/grad_norm"):
        assert got.metrics[key] == pytest.approx(want.metrics[key], rel=0.05, abs=1e-3), key
    assert got.metrics["policy/grad_norm"] != want.metrics["policy/grad_norm"]  # it did compute in bf16
    for name, param in bf16.named_parameters():
        assert param.dtype == torch.float32 and not torch.equal(param, before[name]), name
    # the two moved alike: the update directions agree
    delta = torch.cat([(p - before[n]).flatten() for n, p in bf16.named_parameters()])
    delta32 = torch.cat([(p - before[n]).flatten() for n, p in fp32.named_parameters()])
    assert F.cosine_similarity(delta, delta32, dim=0) > 0.95


def test_autocast_settings_reach_the_learners_step_settings():
    from asyncrl.configs.recipes import load_config
    from asyncrl.learner.loop import loop_settings

    cfg = load_config(None, ["learner.autocast=bfloat16"])
    assert loop_settings(cfg, ParallelState()).step.autocast == "bfloat16"
    auto = load_config(None, ["learner.autocast=auto"])
    assert loop_settings(auto, ParallelState()).step.autocast == resolve_autocast("auto", "cpu")
    assert loop_settings(load_config(None, ["learner.autocast="]), ParallelState()).step.autocast == ""
