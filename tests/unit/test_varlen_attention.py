"""The inner attention of Ulysses: flash-attn's varlen layout (cu_seqlens, [total, heads, dim]) against sdpa with a
block-diagonal mask. On CPU the kernel is a faithful stand-in with flash_attn_varlen_func's signature that runs
sdpa per segment; the `gpu` test runs the real kernel."""
import pytest
import torch

from asyncrl.learner.sequence_attention import cu_seqlens, inner_attention, varlen_kernel


def fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """flash_attn_varlen_func's contract: q [total, h, d], k/v [total, h_kv, d] (h_kv divides h), int32 cu_seqlens,
    causal within each sequence, `window_size=(left, right)` (-1: unbounded; a query attends to keys at most `left`
    before it), `softcap` (0: off; scores -> softcap * tanh(scores / softcap)); returns [total, h, d]."""
    assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    assert q.shape[-1] == k.shape[-1] == v.shape[-1]  # flash-attn 2 takes one head dim for q, k and v
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    assert max(lengths) == max_seqlen_q == max_seqlen_k and sum(lengths) == q.shape[0]
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [h, s, d]
        ks = ks.repeat_interleave(qs.shape[0] // ks.shape[0], dim=0)
        vs = vs.repeat_interleave(qs.shape[0] // vs.shape[0], dim=0)
        index = torch.arange(end - start)
        keep = index[:, None] >= index[None, :] if causal else torch.ones(end - start, end - start, dtype=torch.bool)
        if window_size[0] >= 0:
            keep = keep & (index[:, None] - index[None, :] <= window_size[0])
        scores = qs @ ks.transpose(-1, -2) * (softmax_scale if softmax_scale is not None else qs.shape[-1] ** -0.5)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[start:end] = (scores.masked_fill(~keep, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out


def test_cu_seqlens_marks_where_each_segment_starts():
    bounds, longest = cu_seqlens(torch.tensor([[0, 0, 0, 1, 2, 2, -1, -1]]))
    assert bounds.tolist() == [0, 3, 4, 6, 8] and bounds.dtype == torch.int32 and longest == 3


@pytest.mark.parametrize("packed", [True, False])
def test_varlen_layout_matches_masked_sdpa(packed):
    torch.manual_seed(0)
    batch, length = (1, 13) if packed else (3, 6)
    q = torch.randn(batch, 4, length, 8, dtype=torch.float64)
    k, v = torch.randn(2, batch, 2, length, 8, dtype=torch.float64)  # grouped-query: 2 KV heads for 4
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, -1]]) if packed else None
    expected = inner_attention(q, k, v, segments, 0.3, 0.0, kernel=None)
    got = inner_attention(q, k, v, segments, 0.3, 0.0, kernel=fake_varlen)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_latent_attentions_narrower_values_are_padded_for_the_kernel_and_cut_after():
    """DeepSeek's MLA: q/k heads of 96 (nope + rope), value heads of 32. The kernel gets v padded to 96 and the
    output is cut back to 32, equal to sdpa's, which takes the two widths as they are."""
    torch.manual_seed(2)
    q = torch.randn(1, 4, 13, 12, dtype=torch.float64)
    k = torch.randn(1, 4, 13, 12, dtype=torch.float64)
    v = torch.randn(1, 4, 13, 4, dtype=torch.float64)
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, -1]])
    expected = inner_attention(q, k, v, segments, 0.3, 0.0, kernel=None)
    got = inner_attention(q, k, v, segments, 0.3, 0.0, kernel=fake_varlen)
    assert got.shape == (1, 4, 13, 4)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_no_kernel_on_cpu():
    assert varlen_kernel(torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("value_dim", [64, 32])  # 32: latent attention's narrower values (MLA)
def test_real_flash_attn_varlen_matches_sdpa_on_cuda(value_dim):
    kernel = varlen_kernel(torch.device("cuda"))
    if kernel is None:
        pytest.skip("flash-attn is not installed")
    torch.manual_seed(0)
    q = torch.randn(1, 4, 13, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 2, 13, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, 2, 13, value_dim, dtype=torch.bfloat16, device="cuda")
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, -1]], device="cuda")
    expected = inner_attention(q.float(), k.float(), v.float(), segments, 0.125, 0.0, kernel=None)
    got = inner_attention(q, k, v, segments, 0.125, 0.0, kernel=kernel)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("packed", [True, False])
def test_sliding_window_and_soft_capping_reach_the_varlen_kernel_as_on_cpu(packed):
    """Mistral's and Gemma 2's window and Gemma 2's soft-capping: the varlen kernel's window_size / softcap give what
    the CPU path computes with its mask and plain matmuls."""
    torch.manual_seed(1)
    batch, length = (1, 13) if packed else (3, 6)
    q = torch.randn(batch, 4, length, 8, dtype=torch.float64) * 3
    k, v = torch.randn(2, batch, 2, length, 8, dtype=torch.float64) * 3
    segments = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2]]) if packed else None
    plain = inner_attention(q, k, v, segments, 0.3, 0.0, kernel=None)
    for window, softcap in ((3, None), (None, 2.0), (3, 2.0)):
        expected = inner_attention(q, k, v, segments, 0.3, 0.0, kernel=None, window=window, softcap=softcap)
        got = inner_attention(q, k, v, segments, 0.3, 0.0, kernel=fake_varlen, window=window, softcap=softcap)
        torch.testing.assert_close(got, expected)
        assert not torch.allclose(expected, plain)  # each setting changes the result: none is silently dropped
