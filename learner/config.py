"""Learner and SFT settings (stdlib only)."""
from dataclasses import dataclass, field
from typing import List, Optional

from asyncrl.learner.lr_schedule import SCHEDULES

AUTOCAST_DTYPES = ("bfloat16",)
"""What learner.autocast takes besides "" (off) and "auto". float16 would need a gradient scaler; bf16 has fp32's
range."""


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The linear layers of a Llama/Qwen-style decoder, which vLLM's LoRA serves (not the embeddings or the LM head)."""


@dataclass
class LoraSettings:
    """LoRA RL (learner/lora.py): only low-rank adapters on the target modules train, and only they are published
    (the generators' engines serve each version as an adapter). rank 0: off, every weight trains."""

    rank: int = 0
    """The adapters' rank r (0 = no LoRA). vLLM serves ranks up to 512."""
    alpha: float = 16.0
    """The adapters' scale is alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training. Above 0 the learner's logprobs are noisy against the
    sampler's, which the importance ratios then read as off-policy drift: keep it 0 for RL unless you mean it."""
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names (their last component) that get an adapter."""

    def __post_init__(self):
        if self.rank < 0 or self.rank > 512:
            raise ValueError(f"learner.lora.rank must be in [0, 512] (0 = no LoRA), got {self.rank}")
        if self.rank and self.alpha <= 0:
            raise ValueError(f"learner.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"learner.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.rank and not self.target_modules:
            raise ValueError("learner.lora.target_modules is empty: name the layers that get an adapter")
        bad = [name for name in self.target_modules if name in ("embed_tokens", "lm_head")]
        if self.rank and bad:
            raise ValueError(f"learner.lora.target_modules names {bad}: vLLM serves adapters on linear layers only, "
                             f"not on the embeddings or the LM head")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class LearnerConfig:
    total_steps: int = 200
    """Optimizer steps in the job; the learner's version counts them."""
    lr: float = 1e-4
    """AdamW peak learning rate."""
    warmup_steps: int = 10
    """Linear learning-rate warmup, in optimizer steps."""
    lr_schedule: str = "constant"
    """After warmup: `constant`, `linear` or `cosine` decay to min_lr_ratio · lr at total_steps
    (learner/lr_schedule.py). A job no longer than its warmup never decays (a smoke run of a few steps is allowed,
    and the learner logs that it stays in warmup)."""
    min_lr_ratio: float = 0.0
    """Where linear or cosine decay ends, as a fraction of lr."""
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
    autocast: str = ""
    """Mixed precision over the learner.dtype parameters: "bfloat16" runs the policy's (and the reference's and
    PRM's) linear layers under `torch.autocast` in bf16, with the parameters, optimizer state, norms and softmaxes in
    fp32 and, on CPU, attention in fp32 (learner/precision.py); "auto" is bfloat16 where the hardware computes bf16
    natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX-BF16) and off elsewhere; "" (off) computes in
    learner.dtype. On a CPU with AVX512-BF16 it cut the demo's step from 285 to 190 ms. The critic's passes stay in
    learner.dtype."""
    wait_for_batch_timeout_s: float = 600.0
    """How long the learner waits for enough groups before it gives up and names the missing generators, in s."""
    packing: bool = False
    """Run each micro-batch's decoder as one packed row (no padding tokens; block-diagonal causal attention).
    Off by default: on CPU sdpa attends over the whole packed row, which costs more than it saves on short rows."""
    torch_threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""
    seed: Optional[int] = None
    """Seed for the learner's RNG (initialisation, dropout, Clip-Cov's sampling); None: job.seed."""
    attn_implementation: str = "auto"
    """Attention kernel: "auto" (flash_attention_2 on CUDA when flash-attn is installed, else sdpa), "sdpa",
    "flash_attention_2" or "eager". With sp_size > 1 Ulysses wraps it (its inner attention follows the same rule)."""
    sp_size: int = 1
    """Ulysses sequence-parallel size: ranks that split each sequence (must divide the number of ranks and the
    attention heads). The data-parallel size is ranks / sp_size."""
    sp_impl: str = "native"
    """Which all-to-all carries Ulysses: "native" (asyncrl's, learner/ulysses.py) or "deepspeed" (DeepSpeed's
    `DistributedAttention`, the `deepspeed` extra; its first use compiles a shared-memory op, about 40 s on CPU,
    cached after). Both wrap the same inner attention and agree bit for bit on gloo."""
    param_dtype: str = ""
    """FSDP2 MixedPrecisionPolicy: dtype of the gathered parameters in forward/backward ("" = learner.dtype)."""
    reduce_dtype: str = "float32"
    """FSDP2 MixedPrecisionPolicy: dtype gradients are reduced in."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (less memory, ~1/3 more
    compute)."""
    liger: bool = False
    """The LM head's logprobs through liger-kernel's fused linear + cross-entropy (learner/liger_head.py): its
    [tokens, V] logits never reach memory. Triton: CUDA only (the `gpu` extra). Not with top-k / top-p sampling, the
    entropy bonus or final-logit soft-capping; the entropy metric costs one more no-grad head pass."""
    moe_routing_replay: bool = False
    """Mixture-of-experts models: the generators record the experts each sampled token was routed to and the
    learner's forward replays them, so π_θ is computed on the sampler's routes (moe/routing.py; docs/algorithms.md
    §4.8). The router still trains through the replayed experts' weights. Single-turn samples, padded micro-batches
    (no packing, sp_size 1), the hf engine (vLLM: GPU only, its capture needs Model Runner V2)."""
    freeze_vision: bool = False
    """Vision-language models: hold the vision tower (its patch embedding, blocks and merger) fixed and train the
    language model alone (docs/vision.md). Off: the whole model trains."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: keep sharded parameters, gradients and optimizer state in host memory (GPU only)."""
    max_consecutive_skips: int = 3
    """Steps in a row whose batch may poison them (a non-finite loss or gradient, a batch that cannot be built)
    before the job stops with an error: one bad batch is skipped, a run that can no longer train is not hidden."""
    quarantine_abs_diff: float = 1.0
    """A generator whose last `quarantine_window_groups` trained groups' mean |behaviour - learner logprob| per token
    exceeds this many nats is quarantined: its further groups are refused (buffer/rejected/quarantined) and the log
    names it (learner/trust.py says why 1.0: honest engines, bf16 and fp8 included, stay below 0.2). 0 turns the
    quarantine off (the mismatch is still measured and named in warnings): only for an engine known to sample from
    another distribution than the learner's model, whose mismatch a correction (algo.correction) is meant to
    absorb."""
    quarantine_window_groups: int = 8
    """How many of a generator's most recent trained groups `quarantine_abs_diff` averages over: one odd group
    never decides alone."""
    dist_timeout_s: float = 1800.0
    """Timeout of the learner's collectives (gloo/NCCL), in s; a rank that stops answering fails the job then."""
    gather_bucket_mb: float = 256.0
    """When a version is published, the full weights are gathered from the FSDP shards this many MiB at a time (the
    learner's memory peak; weightsync.bucket_mb is the size of the buckets they are then sent in)."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many steps (and after the last); 0 turns checkpoints off."""
    checkpoint_keep: int = 2
    """Keep the newest this many checkpoints; 0 keeps all."""
    checkpoint_async: bool = False
    """Write checkpoints in the background (DCP async_save) while training continues."""
    checkpoint_dir: str = ""
    """Where checkpoints go ("" = <job dir>/checkpoints). Set a fixed path to make a restarted job continue on its
    own (resume=auto); a fresh job directory has no checkpoints, so a new run never resumes by accident."""
    resume: str = "auto"
    """"auto": continue from the newest checkpoint in the checkpoint directory if there is one; "never": start
    fresh; or the path of a checkpoint (or of a checkpoint root) to start from (`asyncrl learner --resume PATH`)."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA RL: adapters only train and publish (rank 0: off)."""

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"learner.total_steps must be >= 1, got {self.total_steps}")
        if self.lr <= 0:
            raise ValueError(f"learner.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"learner.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"learner.lr_schedule must be one of {SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"learner.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ValueError("learner.min_lr_ratio is where a decay ends, and learner.lr_schedule=constant does not "
                             "decay; set learner.lr_schedule=linear or cosine, or leave min_lr_ratio at 0")
        if self.max_tokens_per_microbatch < 16:
            raise ValueError(f"learner.max_tokens_per_microbatch must be >= 16, got {self.max_tokens_per_microbatch}")
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"learner.logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"learner.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.autocast not in ("", "auto", *AUTOCAST_DTYPES):
            raise ValueError(f"learner.autocast must be \"\" (off), \"auto\" or one of {AUTOCAST_DTYPES}, got "
                             f"{self.autocast!r}")
        if self.wait_for_batch_timeout_s <= 0:
            raise ValueError(f"learner.wait_for_batch_timeout_s must be > 0, got {self.wait_for_batch_timeout_s}")
        if self.attn_implementation not in ("auto", "sdpa", "flash_attention_2", "eager"):
            raise ValueError(f"learner.attn_implementation must be auto, sdpa, flash_attention_2 or eager, got "
                             f"{self.attn_implementation!r}")
        if self.sp_size < 1:
            raise ValueError(f"learner.sp_size must be >= 1, got {self.sp_size}")
        if self.sp_impl not in ("native", "deepspeed"):
            raise ValueError(f"learner.sp_impl must be native or deepspeed, got {self.sp_impl!r}")
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value and value not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"learner.{key} must be float32, bfloat16 or float16, got {value!r}")
        if self.max_consecutive_skips < 1:
            raise ValueError(f"learner.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")
        if not self.quarantine_abs_diff >= 0:  # NaN too
            raise ValueError(f"learner.quarantine_abs_diff must be >= 0 (0: off), got {self.quarantine_abs_diff}")
        if self.quarantine_window_groups < 1:
            raise ValueError(f"learner.quarantine_window_groups must be >= 1, got {self.quarantine_window_groups}")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"learner.dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        if self.gather_bucket_mb <= 0:
            raise ValueError(f"learner.gather_bucket_mb must be > 0, got {self.gather_bucket_mb}")
        if self.checkpoint_every < 0 or self.checkpoint_keep < 0:
            raise ValueError(f"learner.checkpoint_every and learner.checkpoint_keep must be >= 0, got "
                             f"{self.checkpoint_every}, {self.checkpoint_keep}")
        if not self.resume:
            raise ValueError('learner.resume must be "auto", "never" or a checkpoint path')
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(f"learner.adam_beta1/adam_beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")


@dataclass
class CriticConfig:
    """The value model of PPO with a critic (algo.advantage=gae, or algo.vtrace_values=critic); learner/critic.py.
    Unused, and refused when set, by every other algorithm."""

    model_path: str = ""
    """A local HF directory for the critic ("" = the policy's weights with a fresh value head, zero-initialised so
    the first values are 0). A token-classification checkpoint with one label keeps its head."""
    lr: float = 1e-5
    """The critic's AdamW learning rate (its own optimizer; verl's critic default)."""
    weight_decay: float = 0.0
    """The critic's AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm of the critic; <= 0 disables clipping."""
    cliprange_value: float = 0.5
    """The value prediction is clipped to within this of the values the advantages used (verl's cliprange_value)."""
    warmup_steps: int = 0
    """The job's first steps train only the critic: the policy does not move, so the advantages of its first
    updates come from a critic that has seen some returns."""
    max_tokens_per_microbatch: int = 0
    """Token budget of one critic micro-batch (0 = learner.max_tokens_per_microbatch)."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"critic.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"critic.weight_decay must be >= 0, got {self.weight_decay}")
        if self.cliprange_value <= 0:
            raise ValueError(f"critic.cliprange_value must be > 0, got {self.cliprange_value}")
        if self.warmup_steps < 0:
            raise ValueError(f"critic.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_tokens_per_microbatch and self.max_tokens_per_microbatch < 16:
            raise ValueError(f"critic.max_tokens_per_microbatch must be 0 or >= 16, got "
                             f"{self.max_tokens_per_microbatch}")


@dataclass
class PRMConfig:
    """PRIME's implicit process reward model (algo.advantage=prime); learner/prm.py, algos/prime.py. Unused, and
    refused when set, by every other algorithm. Defaults are verl's PRIME recipe's (recipe/prime/config/
    prime_trainer.yaml)."""

    model_path: str = ""
    """A local HF causal-LM directory for the PRM ("" = the policy's starting weights, as verl's recipe does). Its
    rewards are log-ratios to the reference model, the policy's starting weights: a PRM from elsewhere must share
    the policy's tokenizer."""
    lr: float = 1e-6
    """The PRM's AdamW learning rate (its own optimizer, constant)."""
    weight_decay: float = 0.0
    """The PRM's AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm of the PRM; <= 0 disables clipping."""
    beta: float = 0.05
    """β of the implicit reward β log(π_φ/π_ref), in the PRM's loss and in its token rewards (verl's beta_train)."""
    process_coef: float = 5.0
    """Weight of the PRM's token rewards in the advantage (verl's reward_dpo_coef); 0 leaves them out."""
    outcome_coef: float = 5.0
    """Weight of the outcome reward in the advantage (verl's reward_gt_coef); 0 leaves it out."""
    norm: str = "batch_norm"
    """batch_norm: token rewards divided by the batch's largest |return-to-go| (verl's prime_norm); none."""
    update: str = "before"
    """before: the PRM trains on the step's batch, then scores it (verl's default: the rewards come from a PRM that
    has seen these outcomes); after: it scores with its step-start weights and trains once the policy has stepped;
    none: a frozen PRM (its token rewards are then 0 until model_path gives a trained one)."""

    def __post_init__(self):
        if self.lr <= 0 or self.beta <= 0:
            raise ValueError(f"prm.lr and prm.beta must be > 0, got {self.lr}, {self.beta}")
        if self.weight_decay < 0 or self.process_coef < 0 or self.outcome_coef < 0:
            raise ValueError("prm.weight_decay, prm.process_coef and prm.outcome_coef must be >= 0")
        if self.process_coef == 0 and self.outcome_coef == 0:
            raise ValueError("prm.process_coef and prm.outcome_coef are both 0: the advantages would all be 0")
        if self.norm not in ("batch_norm", "none"):
            raise ValueError(f"prm.norm must be batch_norm or none, got {self.norm!r}")
        if self.update not in ("before", "after", "none"):
            raise ValueError(f"prm.update must be before, after or none, got {self.update!r}")


@dataclass
class SFTConfig:
    steps: int = 60
    """Optimizer steps of supervised fine-tuning, each on batch_size examples sampled with the step's seed (used
    when epochs is 0)."""
    epochs: int = 0
    """Passes over the data, each example once per epoch in a seeded order (> 0 replaces steps)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup, in optimizer steps."""
    lr_schedule: str = "constant"
    """After warmup: constant, linear or cosine decay to min_lr_ratio · lr at the last step."""
    min_lr_ratio: float = 0.0
    """Where linear or cosine decay ends, as a fraction of lr."""
    val_files: List[str] = field(default_factory=list)
    """Validation parquet (the training format); without it, val_fraction of the data is held out."""
    val_fraction: float = 0.0
    """Share of the examples held out (seeded) for the validation loss when val_files is empty; 0: none."""
    val_every: int = 0
    """Validation loss every this many steps (and at the end); 0: at the end only."""
    checkpoint_every: int = 0
    """A resumable checkpoint every this many steps and at the end (learner.checkpoint_dir, checkpoint_keep;
    `asyncrl sft --resume`); 0: none."""
    lr: float = 1e-3
    """AdamW learning rate for SFT."""
    batch_size: int = 128
    """Sequences per SFT step."""
    seed: Optional[int] = None
    """Seed for shuffling, the validation split and init; None: job.seed."""
    max_length: int = 0
    """Longest example in tokens (0 = no limit); what happens to longer ones is `truncation`."""
    truncation: str = "error"
    """Examples longer than max_length: "error" (stop and name the row), "drop" (skip, counted) or "right" (cut)."""
    save_dir: Optional[str] = None
    """Where the fine-tuned model is saved (an HF model directory, what `model.path` of the next job names); None:
    `model/` in the job directory."""
    torch_threads: int = 0
    """torch intra-op threads of `asyncrl sft`; 0 keeps torch's default (one per core: SFT runs alone). Set it
    when other work shares the cores: torch's threads then spin in OpenMP barriers, and a step can take tens of
    times longer. (learner.torch_threads is the RL learner's, which shares its cores with generators.)"""

    def __post_init__(self):
        if self.max_length < 0:
            raise ValueError(f"sft.max_length must be >= 0, got {self.max_length}")
        if self.truncation not in ("error", "drop", "right"):
            raise ValueError(f"sft.truncation must be error, drop or right, got {self.truncation!r}")
        if self.steps < 0:
            raise ValueError(f"sft.steps must be >= 0, got {self.steps}")
        if self.lr <= 0:
            raise ValueError(f"sft.lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"sft.batch_size must be >= 1, got {self.batch_size}")
        if self.epochs < 0 or self.warmup_steps < 0 or self.val_every < 0 or self.checkpoint_every < 0:
            raise ValueError("sft.epochs, sft.warmup_steps, sft.val_every and sft.checkpoint_every must be >= 0")
        if self.torch_threads < 0:
            raise ValueError(f"sft.torch_threads must be >= 0 (0: torch's default), got {self.torch_threads}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"sft.lr_schedule must be one of {SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"sft.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ValueError("sft.min_lr_ratio is where a decay ends, and sft.lr_schedule=constant does not decay")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"sft.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_files and self.val_fraction:
            raise ValueError("sft.val_files and sft.val_fraction both name a validation split; keep one")
