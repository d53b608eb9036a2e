"""The set of tokens an engine samples from under top-k / top-p, so the learner's logprobs describe the same
distribution as the engine's processed logprobs.

With `rollout.top_p < 1` or `top_k > 0` the engine samples from the tempered distribution restricted to a nucleus
and renormalised there, and records that distribution's logprob (vLLM `processed_logprobs`). A learner that takes
log_softmax over the whole vocabulary computes a different number for every token, a bias the importance ratio
then reads as off-policyness. This module reproduces vLLM's masks (v1/sample/ops/topk_topp_sampler.py,
`apply_top_k_top_p_pytorch`), applied after the temperature:
- top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept);
- top-p then sorts the top-k survivors ascending, and removes the tokens whose cumulative probability (of the
  top-k-renormalised distribution) is <= 1 - p, always keeping the most likely token.

The sampled token itself is always kept. The engine sampled it from its nucleus, so with the same weights it is
in the learner's nucleus too; with other weights (a stale sample, the current policy after an update) it may not
be, and its logprob would be -inf, which no ratio survives. The set is chosen without gradient: the gradient flows
through the logits of the kept tokens.
"""
import torch


@torch.no_grad()
def nucleus_removed(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    targets: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: the tokens outside each row's nucleus. `logits` [N, V] tempered; `top_k` [N] (<= 0 or >= V:
    off); `top_p` [N] (>= 1: off); `targets` [N], kept whatever the masks say."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending, as vLLM
    removed = torch.zeros_like(sorted_logits, dtype=torch.bool)
    use_k = (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).long()[:, None])  # [N, 1]
        removed |= (sorted_logits < kth) & use_k[:, None]
    use_p = top_p < 1.0
    if bool(use_p.any()):
        cumulative = sorted_logits.masked_fill(removed, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
        by_p = cumulative <= (1.0 - top_p.to(cumulative.dtype))[:, None]
        by_p[:, -1] = False  # at least the most likely token
        removed |= by_p & use_p[:, None]
    removed = torch.zeros_like(removed).scatter(1, order, removed)
    removed[torch.arange(len(targets)), targets] = False
    return removed


def needs_nucleus(top_k: torch.Tensor | None, top_p: torch.Tensor | None, vocab: int) -> bool:
    """Whether any row samples from a restricted set (else the full softmax is the engine's distribution)."""
    return bool(top_k is not None and ((top_k > 0) & (top_k < vocab)).any()) or bool(
        top_p is not None and (top_p < 1.0).any())
