"""The LM head's logprobs through liger-kernel's fused linear + cross-entropy (`learner.liger`).

Why: the head's matmul against the vocabulary is the largest single op of a small model's step, and its [tokens, V]
fp32 logits the largest activation of a large-vocabulary one. asyncrl's own head (learner/logprobs.py) bounds that by
chunks, recomputing each chunk's logits in backward; liger-kernel's Triton kernel fuses the matmul, the softmax and
its backward so the logits never reach memory at all. Its public entry point computes a cross-entropy, and the
logprob of a token is minus its cross-entropy (reduction "none": one value per position), at temperature T when the
hidden states are divided by T first (logits / T = (h / T) W^T + b / T: so the bias, which no supported family's
head has, is refused rather than scaled wrongly).

What it does not do, each refused where it would be wrong: top-k / top-p sampling (the logprob of the sampled
nucleus needs the logits it never materialises), the entropy bonus (its gradient needs them too), final-logit
soft-capping (Gemma 2's: applied after the temperature it would cap the wrong logits). The entropy *metric* is still
reported: computed without gradient, chunk by chunk, by the plain head (one more matmul per chunk, no memory kept).
The kernel is Triton: CUDA only (tests/gpu/test_liger_head.py); on CPU the learner refuses the setting.
"""
import torch


def liger_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """[N] fp32 logprobs of `targets` under softmax((hidden W^T) / temps), with gradient to `hidden` and the head's
    weight, through liger_fused_linear_cross_entropy (hidden [N, H], targets [N], temps [N])."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if getattr(head, "bias", None) is not None:
        raise ValueError("learner.liger: the LM head has a bias, which the temperature would have to scale too; "
                         "turn learner.liger off for this model")
    scaled = hidden / temps[:, None].to(hidden.dtype)
    losses = liger_fused_linear_cross_entropy(scaled, head.weight, targets, reduction="none")
    return -losses.float()


def check_liger_available() -> None:
    """Raise with the reason unless liger-kernel can run here: installed, and a CUDA device for its Triton kernels."""
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError as err:
        raise RuntimeError(f"learner.liger needs liger-kernel ({err}): pip install 'asyncrl[gpu]'") from None
    if not torch.cuda.is_available():
        raise RuntimeError("learner.liger runs liger-kernel's Triton kernels, which need a CUDA device; this learner "
                           "has none (turn learner.liger off on CPU: the plain head chunks its logits already)")
