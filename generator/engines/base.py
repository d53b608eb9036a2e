"""What every engine provides: token ids in, token ids + processed logprobs + per-token versions out.

Engines: `vllm` (AsyncLLM), `sglang` (sglang.Engine, CUDA only), `hf` (plain transformers, the reference). Each
satisfies `Engine`; those the learner can push versions into from its GPU (weightsync.backend=engine_push) also
satisfy `PushableEngine`, and the generator asks that type question (generator/weights.py) rather than probing for
methods. `staged` is a complete, verified version in the generator's staging mapping (weightsync/receiver.py);
`fallback` is the last good one (None: the model's own files). A load either completes or goes back to `fallback`
and raises WeightLoadError; if going back fails too, it raises EngineBroken and never samples again. No engine ever
samples from partly loaded weights.

Every engine is built from one `EngineOptions` (make_engine): the settings all engines read, plus a section per
engine for the knobs only it reads, so a caller never builds another engine's keywords.
"""
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable


@dataclass
class Completion:
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # logprob of each token under the distribution sampled from
    versions: list = field(default_factory=list)  # policy version of the weights that sampled each token
    finish_reason: str = "length"


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

    async def sample(self, prompt_ids: list, sampling, n: int) -> list[Completion]: ...

    async def load_weights(self, staged, fallback=None) -> None: ...

    async def close(self) -> None: ...


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
    vllm: VllmOptions = field(default_factory=VllmOptions)
    sglang: SglangOptions = field(default_factory=SglangOptions)


def engine_options(gen, model, model_path: str, seed: int, lora_rank=0, max_staleness: int = 0,
                   ipc_push: bool = False) -> EngineOptions:
    """The options of the engine generator.engine, from the generator and model sections: the one place that reads
    the vLLM-only knobs. `lora_rank`: a LoRA learner's rank (its run info's `lora_rank`, learner.lora.rank: the
    learner's setting, whatever the generator's recipe says); it publishes adapters, which the vLLM engine serves
    as such, up to that rank and every version the buffer admits (`max_staleness` + 1) at once; the hf engine needs
    nothing up front. `ipc_push`: the learner pushes through CUDA IPC (weightsync.engine_transport=ipc)."""
    vllm = VllmOptions()
    if gen.engine == "vllm":
        lora = {}
        if lora_rank:
            if not isinstance(lora_rank, int) or isinstance(lora_rank, bool) or not 1 <= lora_rank <= 512:
                raise ValueError(f"the learner announced LoRA rank {lora_rank!r}, which is not an integer in [1, 512]")
            lora = {"lora_rank": lora_rank, "max_loras": max_staleness + 1}
        vllm = VllmOptions(tensor_parallel_size=gen.vllm.tensor_parallel_size,
                           gpu_memory_utilization=gen.vllm.gpu_memory_utilization, enforce_eager=gen.vllm.enforce_eager,
                           enable_prefix_caching=gen.vllm.enable_prefix_caching, lm_head_fp32=model.lm_head_fp32,
                           ipc_push=ipc_push, **lora)
    return EngineOptions(model_path, gen.dtype, gen.max_model_len, gen.kv_cache_gib, seed,
                         update_mode=gen.update_mode, trust_remote_code=model.trust_remote_code, vllm=vllm)


def make_engine(name: str, options: EngineOptions) -> Engine:
    """Engines are imported lazily: vLLM is heavy and may be absent (then use `hf`)."""
    if name == "vllm":
        try:
            from asyncrl.generator.engines.vllm_engine import VllmEngine
        except ImportError as err:
            raise RuntimeError(
                f"generator.engine=vllm but vLLM cannot be imported ({err}); install the `cpu` or `gpu` extra, "
                "or use generator.engine=hf"
            ) from None
        return VllmEngine(options)
    if name == "sglang":
        from asyncrl.generator.engines.sglang_engine import SglangEngine

        if options.sglang.engine_factory is None:  # a test's fake needs no SGLang
            try:
                import sglang  # noqa: F401
            except ImportError as err:
                raise RuntimeError(
                    f"generator.engine=sglang but SGLang cannot be imported ({err}); it needs CUDA "
                    "(pip install 'asyncrl[sglang]', in an environment without vLLM), or use "
                    "generator.engine=vllm or hf"
                ) from None
        return SglangEngine(options)
    if name == "hf":
        from asyncrl.generator.engines.hf_engine import HfEngine

        return HfEngine(options)
    raise ValueError(f"unknown engine {name!r}")
