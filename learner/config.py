"""Learner and SFT settings (stdlib only)."""
from dataclasses import dataclass


@dataclass
class LearnerConfig:
    total_steps: int = 200
    """Optimizer steps in the job; the learner's version counts them."""
    lr: float = 1e-4
    """AdamW peak learning rate."""
    warmup_steps: int = 10
    """Linear learning-rate warmup, in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW β1."""
    adam_beta2: float = 0.999
    """AdamW β2."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0 disables clipping."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one forward/backward micro-batch (padded tokens count)."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk when turning hidden states into logprobs, so [B, T, V] fp32 logits never exist at once."""
    dtype: str = "float32"
    """Parameter dtype of the learner."""
    wait_for_batch_timeout_s: float = 600.0
    """How long the learner waits for enough groups before it gives up and names the missing generators, in s."""
    packing: bool = False
    """Run each micro-batch's decoder as one packed row (no padding tokens; block-diagonal causal attention).
    Off by default: on CPU sdpa attends over the whole packed row, which costs more than it saves on short rows."""
    done_grace_s: float = 20.0
    """After the last step, how long the learner keeps answering so every generator hears "done", in s."""
    torch_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""
    seed: int = 0
    """Seed for the learner's RNG."""

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"learner.total_steps must be >= 1, got {self.total_steps}")
        if self.lr <= 0:
            raise ValueError(f"learner.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"learner.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_tokens_per_microbatch < 16:
            raise ValueError(f"learner.max_tokens_per_microbatch must be >= 16, got {self.max_tokens_per_microbatch}")
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"learner.logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"learner.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.done_grace_s < 0:
            raise ValueError(f"learner.done_grace_s must be >= 0, got {self.done_grace_s}")
        if self.wait_for_batch_timeout_s <= 0:
            raise ValueError(f"learner.wait_for_batch_timeout_s must be > 0, got {self.wait_for_batch_timeout_s}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(f"learner.adam_beta1/adam_beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")


@dataclass
class SFTConfig:
    steps: int = 60
    """Optimizer steps of supervised fine-tuning."""
    lr: float = 1e-3
    """AdamW learning rate for SFT."""
    batch_size: int = 128
    """Sequences per SFT step."""
    seed: int = 0
    """Seed for shuffling and init."""

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"sft.steps must be >= 0, got {self.steps}")
        if self.lr <= 0:
            raise ValueError(f"sft.lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"sft.batch_size must be >= 1, got {self.batch_size}")
