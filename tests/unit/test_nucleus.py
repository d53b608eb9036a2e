"""The learner's top-k / top-p nucleus: vLLM's masks, the sampled token kept, gradients finite."""
import math

import pytest
import torch

from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.nucleus import nucleus_removed


def test_a_hand_computed_nucleus():
    # probabilities 0.5, 0.25, 0.125, 0.125 (logits log p)
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    keep = lambda k, p, target=0: (~nucleus_removed(logits, torch.tensor([k]), torch.tensor([p]),  # noqa: E731
                                                    torch.tensor([target]))).tolist()[0]
    assert keep(-1, 0.7) == [True, True, False, False]  # 0.5 alone is < 0.7, 0.5 + 0.25 reaches it
    assert keep(-1, 0.5) == [True, False, False, False]
    assert keep(-1, 1.0) == [True, True, True, True]
    assert keep(3, 1.0) == [True, True, True, True]  # ties at the k-th value are kept, as in vLLM
    assert keep(1, 1.0) == [True, False, False, False]
    assert keep(2, 0.6) == [True, False, False, False]  # top-p over the top-k renormalised: 2/3 >= 0.6
    assert keep(2, 0.7) == [True, True, False, False]  # 2/3 < 0.7
    assert keep(1, 1.0, target=3) == [True, False, False, True]  # the sampled token is always kept


def test_the_masks_are_vllms_on_random_logits():
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    top_k = torch.randint(1, 60, (64,))  # some rows >= the vocabulary: off
    top_p = torch.rand(64) * 0.9 + 0.1
    top_p[::5] = 1.0
    theirs = vllm_ops.apply_top_k_top_p_pytorch(logits.clone(), top_k.clamp(max=50), top_p)
    ours = nucleus_removed(logits, top_k, top_p, targets=logits.argmax(-1))
    assert torch.equal(ours, theirs.isinf())


def test_learner_logprobs_over_a_nucleus_are_renormalised_with_finite_gradients():
    model = build_qwen2(vocab_size=32, hidden_size=32, num_layers=1, eos_token_id=1, pad_token_id=0, seed=0).double()
    ids = torch.tensor([[3, 7, 9, 4, 12, 30]])
    mask = torch.ones_like(ids)
    temps = torch.tensor([0.7])
    full, _ = compute_logprobs(model, ids, mask, temps, 4)
    nucleus, entropy = compute_logprobs(model, ids, mask, temps, 4, with_entropy=True, top_ks=torch.tensor([-1]),
                                        top_ps=torch.tensor([0.5]))
    assert bool((nucleus >= full - 1e-12).all()) and bool((nucleus > full + 1e-6).any())  # mass renormalised
    assert bool(torch.isfinite(nucleus).all()) and bool((entropy < math.log(32)).all())
    nucleus.sum().backward()  # tokens outside their position's nucleus keep finite logprobs and gradients
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    off, _ = compute_logprobs(model, ids, mask, temps, 4, top_ks=torch.tensor([-1]), top_ps=torch.tensor([1.0]))
    assert torch.allclose(off, full)
    packed, _ = compute_logprobs(model, ids, mask, temps, 4, packed=True, top_ks=torch.tensor([-1]),
                                 top_ps=torch.tensor([0.5]))
    assert torch.allclose(packed, nucleus)


def test_an_fp32_head_removes_the_bf16_rounding_of_the_logits():
    """With bf16 weights the plain head rounds the logits to bf16; model.lm_head_fp32 computes them from the same
    weights in fp32, as the fp32 reference does (up to the bf16 rounding of the weights and states themselves)."""
    model = build_qwen2(vocab_size=32, hidden_size=32, num_layers=1, eos_token_id=1, pad_token_id=0, seed=0)
    ids = torch.tensor([[3, 7, 9, 4, 12, 30]])
    mask, temps = torch.ones_like(ids), torch.tensor([1.0])
    bf16 = model.to(torch.bfloat16)
    plain, _ = compute_logprobs(bf16, ids, mask, temps, 4)
    fp32_head, _ = compute_logprobs(bf16, ids, mask, temps, 4, fp32_head=True)
    hidden = bf16(ids, output_hidden_states=True).hidden_states[-1][0, :-1]
    reference = (hidden.float() @ bf16.lm_head.weight.float().T).log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(fp32_head[0], reference, atol=1e-5)
    assert not torch.allclose(plain[0], reference, atol=1e-5)
