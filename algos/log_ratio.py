"""The log-ratio of two policies on sampled tokens, defined once for every loss, correction, metric and KL term.

ℓ - ℓref of bf16 log-probs loses most of its digits, and the tensors carry garbage where the mask is 0 (-inf
log-probs at padding, whose difference -inf - -inf is NaN). So the difference is taken in fp32 at least, the
masked positions are replaced BEFORE the subtraction (``torch.where``, never a multiplication by the mask: 0 * NaN
is NaN, and a NaN reaches exp() and its backward), a NaN on a valid token counts as 0 (AReaL's rule: one corrupt
log-prob must not poison the step), and the result is clamped to ±LOG_RATIO_CLAMP so that exp() stays finite.
Nothing here detaches: the losses need the gradient through ℓθ, so the callers detach what must not learn.
"""
import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""|log ratio| (per token, and per-sequence sums) is clamped to this before exp (verl, OpenRLHF): e^20 is large but
finite in fp32 and bf16, and so is its square e^40 that the χ² metrics take."""


def masked_log_ratio(logprobs: Tensor, logprobs_ref: Tensor, valid: Tensor, min_dtype: torch.dtype = torch.float32,
                     *, clamp: bool = True) -> Tensor:
    """ℓ - ℓref [B, T], in the wider of the inputs' dtypes and ``min_dtype``; 0 where ``valid`` is False.

    On valid tokens a NaN gives 0 and, with ``clamp``, ±inf gives ±LOG_RATIO_CLAMP and every value is clamped to
    ±LOG_RATIO_CLAMP (the clamp's gradient is 0 outside the range). ``clamp=False`` is for the KL estimators k1 and
    k2, whose value verl leaves unclamped (k3 clamps inside its own formula). The gradient flows to both inputs on
    valid tokens and is exactly 0 on the others.
    """
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, logprobs_ref.dtype), min_dtype)
    diff = torch.where(valid, logprobs.to(dtype), 0.0) - torch.where(valid, logprobs_ref.to(dtype), 0.0)  # [B, T]
    diff = torch.where(torch.isnan(diff), 0.0, diff)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else diff
