"""learner.liger's head (learner/liger_head.py) against the plain chunked head, on CPU with a stand-in for
liger-kernel's `liger_fused_linear_cross_entropy`: the same signature and the cross-entropy it computes, in plain
torch (the real kernel is Triton, CUDA only: tests/gpu/test_liger_head.py runs it). What is checked here is asyncrl's
side: the temperature folded into the hidden states, the sign, the shapes, the gradient, the entropy metric, and
every case it refuses."""
import sys
import types

import pytest
import torch

from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import build_qwen2


def stand_in_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                           lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                           return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                           return_token_accuracy=False, return_predicted_tokens=False, chunk_mem_const=1):
    """liger_kernel.transformers.functional.liger_fused_linear_cross_entropy's contract (v0.8.5), computed plainly."""
    logits = torch.nn.functional.linear(input, weight, bias)
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


@pytest.fixture
def liger(monkeypatch):
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = stand_in_cross_entropy
    transformers = types.ModuleType("liger_kernel.transformers")
    transformers.functional = functional
    package = types.ModuleType("liger_kernel")
    package.transformers = transformers
    for name, module in (("liger_kernel", package), ("liger_kernel.transformers", transformers),
                         ("liger_kernel.transformers.functional", functional)):
        monkeypatch.setitem(sys.modules, name, module)


def batch():
    torch.manual_seed(0)
    ids = torch.randint(1, 40, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask, torch.tensor([1.0, 0.7, 1.3])


def test_the_liger_head_gives_the_plain_heads_logprobs_entropy_and_gradient(liger):
    model = build_qwen2(vocab_size=40, hidden_size=64, num_layers=2, eos_token_id=2, pad_token_id=0, seed=0).double()
    ids, mask, temps = batch()
    results = {}
    for fused in (False, True):
        model.zero_grad()
        logprobs, entropy = compute_logprobs(model, ids, mask, temps, 4, with_entropy=True, liger=fused)
        (logprobs * mask[:, 1:]).sum().backward()
        results[fused] = (logprobs.detach(), entropy, [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(results[True][0], results[False][0].float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(results[True][1].double(), results[False][1].double(), rtol=0, atol=1e-9)
    for fused_grad, plain_grad in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-6, atol=1e-9)


def test_the_liger_head_refuses_what_it_cannot_compute(liger):
    model = build_qwen2(vocab_size=40, hidden_size=64, num_layers=2, eos_token_id=2, pad_token_id=0, seed=0)
    ids, mask, temps = batch()
    with pytest.raises(ValueError, match="top-k / top-p nucleus"):
        compute_logprobs(model, ids, mask, temps, 4, liger=True, top_ks=torch.tensor([5, -1, -1]))
    with pytest.raises(ValueError, match="entropy's gradient"):
        compute_logprobs(model, ids, mask, temps, 4, with_entropy="grad", liger=True)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-capping"):
        compute_logprobs(model, ids, mask, temps, 4, liger=True)


def test_the_config_and_the_learner_refuse_liger_where_it_cannot_run():
    from asyncrl.configs import ConfigError, load_config
    from asyncrl.learner.liger_head import check_liger_available

    for override in ("rollout.top_p=0.9", "algo.entropy_coef=0.01"):
        with pytest.raises(ConfigError, match="learner.liger computes the full softmax"):
            load_config(None, ["learner.liger=true", override])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="learner.liger"):
            check_liger_available()  # not installed on CPU, or no CUDA device for its kernels
