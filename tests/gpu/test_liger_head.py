"""learner.liger on CUDA with the real liger-kernel: the fused linear + cross-entropy's logprobs and gradient against
asyncrl's plain chunked head, on a tiny Qwen2 in fp32 and bf16. Needs CUDA and the `gpu` extra's liger-kernel;
scripts/test_gpu runs it. The CPU test of asyncrl's side, with a stand-in for the kernel: tests/unit/test_liger_head.py."""
import pytest
import torch

from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import build_qwen2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_the_liger_kernel_gives_the_plain_heads_logprobs_and_gradient(dtype, tolerance):
    pytest.importorskip("liger_kernel")
    model = build_qwen2(vocab_size=4096, hidden_size=128, num_layers=2, eos_token_id=2, pad_token_id=0,
                        seed=0).to("cuda", dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 4096, (4, 64), generator=generator).cuda()
    mask = torch.ones_like(ids)
    temps = torch.tensor([1.0, 0.7, 1.0, 1.2], device="cuda")
    results = {}
    for fused in (False, True):
        model.zero_grad()
        logprobs, entropy = compute_logprobs(model, ids, mask, temps, 256, with_entropy=True, liger=fused)
        logprobs.sum().backward()
        results[fused] = (logprobs.detach().float(), entropy.float(), model.lm_head.weight.grad.float().clone())
    assert (results[True][0] - results[False][0]).abs().max() < tolerance
    assert (results[True][1] - results[False][1]).abs().max() < tolerance
    gap = (results[True][2] - results[False][2]).norm() / results[False][2].norm()
    assert gap < tolerance, gap
