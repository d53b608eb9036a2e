"""What every engine provides: token ids in, token ids + processed logprobs + per-token versions out.

Engines: `vllm` (AsyncLLM), `sglang` (sglang.Engine, CUDA only), `hf` (plain transformers, the reference). Each
satisfies `Engine`; those the learner can push versions into from its GPU (weightsync.backend=engine_push) also
satisfy `PushableEngine`, and the generator asks that type question (generator/weights.py) rather than probing for
methods. `staged` is a complete, verified version in the generator's staging mapping (weightsync/receiver.py);
`fallback` is the last good one (None: the model's own files). A load either completes or goes back to `fallback`
and raises WeightLoadError; if going back fails too, it raises EngineBroken and never samples again. No engine ever
samples from partly loaded weights.

Every engine is built from one `EngineOptions` (engines/factory.py::make_engine): the settings all engines read,
plus a section per engine for the knobs only it reads, so a caller never builds another engine's keywords.
"""
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable


@dataclass
class Completion:
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # logprob of each token under the distribution sampled from
    versions: list = field(default_factory=list)  # policy version of the weights that sampled each token
    finish_reason: str = "length"
    cached_tokens: int = 0
    """Prompt tokens the engine found in its prefix cache (vLLM's `num_cached_tokens` of the completion's last
    request; 0 from engines that do not report it): what bench/agent_prefix.py reads to show turn k reusing turn
    k-1's KV cache."""
    routed_experts: object = None
    """With EngineOptions.record_routes: the experts of every position the model ran (prompt and completion but the
    last token), a numpy array [P + T - 1, num_layers, top_k] in `route_dtype` (Sample.routed_experts)."""


class WeightLoadError(RuntimeError):
    """Loading new weights failed; the engine is back on its last good version."""


class EngineBroken(WeightLoadError):
    """A load failed and so did the reload of the last good version: the engine holds weights nobody can vouch
    for, so it stays paused and every later sample raises this. Only a restart brings it back."""


class EngineUnsupported(RuntimeError):
    """The installed engine library is a version this code was not tested against; the message says which versions
    are known to work and what to install. Raised by `start()` before any engine is built."""


@runtime_checkable
class Engine(Protocol):
    version: int
    """The version of the weights it samples with (0: the model's own files)."""
    resumed_requests: int
    """Requests a weight update aborted and the engine resubmitted with their prefix (vLLM's update_mode=abort)."""

    async def start(self) -> None: ...

    async def sample(self, prompt_ids: list, sampling, n: int) -> list[Completion]:
        """`n` completions of one prompt. An engine that samples vision-language models (hf) also takes
        `images=[encoded image, ...]`, one per image pad of `prompt_ids`; the generator passes it only for a row
        that has images."""
        ...

    async def load_weights(self, staged, fallback=None) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class StreamingEngine(Engine, Protocol):
    """An engine that hands out a completion while it grows (vLLM): the agent endpoint streams its tokens as they
    are sampled (generator/agents/openai_stream.py). Others (hf, which batches whole generate calls; SGLang here)
    are answered in one chunk at the end."""

    def sample_stream(self, prompt_ids: list, sampling) -> AsyncIterator[Completion]:
        """One completion, yielded (the same object, growing) after each batch of new tokens; complete (finish
        reason, versions) once the iteration ends. Closing it early aborts the request."""
        ...


@runtime_checkable
class PushableEngine(Engine, Protocol):
    """An engine the learner pushes versions into from its GPU, driven by generator/weights.py::PushedWeights:
    push_init once, then per version push_begin (pause), push_receive (per update), push_commit, or push_recover
    after a failure between begin and commit."""

    push_kind: str
    """Which trainer side the learner opens for this engine (weightsync/engine_push/host.py)."""
    push_ranks: int
    """How many receiving ranks the engine has (its tensor-parallel size)."""
    broken: str | None
    """Why the engine can no longer serve, once it cannot (then every sample raises EngineBroken)."""

    def mark_broken(self, reason: str) -> None: ...

    async def push_init(self, init_info: dict, transport: str = "nccl") -> None: ...

    async def push_begin(self) -> None: ...

    async def push_receive(self, update_info: dict, transport: str = "nccl") -> None: ...

    async def push_commit(self, version: int) -> None: ...

    async def push_recover(self, staged) -> None: ...


@dataclass(frozen=True)
class VllmOptions:
    """Knobs only the vLLM engine reads."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.0
    """> 0: vLLM sizes the KV cache as this fraction of GPU memory; 0: kv_cache_gib sizes it."""
    enforce_eager: bool | None = None
    """None: CUDA graphs on a GPU, eager on CPU."""
    enable_prefix_caching: bool = True
    lm_head_fp32: bool = False
    lora_rank: int = 0
    """> 0: serve LoRA adapters up to this rank (the learner's learner.lora.rank)."""
    max_loras: int = 1
    """Adapters served at once: every version the buffer admits (buffer.max_staleness + 1)."""
    ipc_push: bool = False
    """The learner pushes versions through CUDA IPC handles (weightsync.engine_push with engine_transport=ipc)."""
    max_images: int = 4
    """A vision-language model's images per prompt, what vLLM profiles its memory for (data.max_images)."""


@dataclass(frozen=True)
class SglangOptions:
    """Knobs only the SGLang engine reads."""

    engine_factory: Callable | None = None
    """Builds the engine handle from SGLang's server keywords (None: the real SGLang; tests pass the fake)."""
    timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    server_args: dict = field(default_factory=dict)
    """Extra `sglang.Engine` keywords, e.g. attention_backend or tp_size."""


@dataclass(frozen=True)
class EngineOptions:
    """What an engine is built from."""

    model_path: str
    dtype: str
    max_model_len: int
    kv_cache_gib: float
    """The KV cache's size in GiB (vLLM, SGLang); the hf engine keeps no cache between batches."""
    seed: int
    update_mode: str = "wait"
    """How a weight load treats running requests (generator.update_mode: wait, keep or abort)."""
    trust_remote_code: bool = False
    record_routes: bool = False
    """Record the experts each token was routed to (an MoE model whose learner replays them: moe/routing.py); each
    Completion then carries `routed_experts`. The hf engine records them with hooks; vLLM returns them itself
    (`enable_return_routed_experts`, its Model Runner V2: GPU only); SGLang's engine refuses."""
    takes_versions: bool = False
    """The learner's versions will be loaded into it (a generator's engine), not only its model sampled (`asyncrl
    eval`): an engine that cannot load them refuses at start (vLLM on CPU with an MoE model, CPU_MOE_UPDATES)."""
    vllm: VllmOptions = field(default_factory=VllmOptions)
    sglang: SglangOptions = field(default_factory=SglangOptions)
