"""Building the engine a job names: its `EngineOptions` from the config sections, then the engine itself.

Apart from base.py so that the engines, which import base's types, are not imported back by it: the factory sits
above every engine and imports each one lazily (vLLM and SGLang are heavy and may be absent)."""
from asyncrl.generator.engines.base import Engine, EngineOptions, VllmOptions


def engine_options(gen, model, model_path: str, seed: int, lora_rank=0, max_staleness: int = 0,
                   ipc_push: bool = False, record_routes: bool = False, takes_versions: bool = False,
                   max_images: int = 4) -> EngineOptions:
    """The options of the engine generator.engine, from the generator and model sections: the one place that reads
    the vLLM-only knobs. `lora_rank`: a LoRA learner's rank (its run info's `lora_rank`, learner.lora.rank: the
    learner's setting, whatever the generator's recipe says); it publishes adapters, which the vLLM engine serves
    as such, up to that rank and every version the buffer admits (`max_staleness` + 1) at once; the hf engine needs
    nothing up front. `ipc_push`: the learner pushes through CUDA IPC (weightsync.engine_transport=ipc).
    `record_routes`: the learner replays MoE routes (its run info's `routing_replay`), so the engine records them.
    `takes_versions`: a generator's engine, which the learner's versions will be loaded into (not `asyncrl eval`'s).
    `max_images`: data.max_images, the images per prompt vLLM profiles a vision-language model for."""
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
                           ipc_push=ipc_push, max_images=max_images, **lora)
    return EngineOptions(model_path, gen.dtype, gen.max_model_len, gen.kv_cache_gib, seed,
                         update_mode=gen.update_mode, trust_remote_code=model.trust_remote_code, vllm=vllm,
                         record_routes=record_routes, takes_versions=takes_versions)


def make_engine(name: str, options: EngineOptions) -> Engine:
    """Engines are imported lazily: vLLM is heavy and may be absent (then use `hf`)."""
    from asyncrl.data.vision import is_vision_dir

    if name == "sglang" and is_vision_dir(options.model_path):
        raise RuntimeError(f"model {options.model_path} is a vision-language model, and asyncrl's SGLang engine does "
                           f"not take images: use generator.engine=vllm (GPU) or hf (docs/vision.md)")
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

        if options.record_routes:
            raise RuntimeError("the learner replays MoE routes (learner.moe_routing_replay), and asyncrl's SGLang "
                               "engine does not record them: use generator.engine=vllm (GPU) or hf")

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
