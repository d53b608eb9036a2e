"""SGLang engine through its offline `sglang.Engine`: token ids in and out, temperature-processed logprobs.

Written against SGLang 0.5.x (>= 0.5.6 for pause modes), from sgl-project/sglang's
`python/sglang/srt/entrypoints/engine.py`, `managers/tokenizer_manager.py`, `managers/tokenizer_communicator_mixin.py`,
`managers/io_struct.py` and `docs/advanced_features/sglang_for_rl.md`. Not run here: SGLang needs CUDA; the
unit tests use `tests/fakes/fake_sglang.py` and `tests/gpu/test_sglang_real.py` runs the real one.

Simplifications and why:
  * Weights come in two ways (sglang_receiver.py): `load_weights(staged, fallback)` sends a version from the
    generator's staging to `update_weights_from_tensor`, and with weightsync.backend=engine_push the learner
    pushes versions from its GPU through `init_weights_update_group` + `update_weights_from_distributed` (the
    `push_*` methods). A failed load goes back to a complete version or to the model's own files.
  * `sglang.Engine`'s control methods (`update_weights_from_tensor`, `flush_cache`, ...) call
    `loop.run_until_complete`, which cannot run inside our event loop, and `pause_generation` /
    `continue_generation` exist only on its tokenizer manager (and as HTTP routes). `AsyncSglangEngine` awaits
    the tokenizer manager with the same request objects the Engine methods build -- the pattern verl's
    `AsyncEngine` uses -- and keeps the Engine methods' names and keywords, so the fake mirrors one surface.
  * Logprobs: SGLang reports log_softmax(logits / temperature) of the sampled token, before top-k/top-p
    renormalisation (unless SGLANG_RETURN_ORIGINAL_LOGPROB is set, which makes them raw). asyncrl needs the
    distribution actually sampled from, so a sampling with top-k or top-p is refused rather than mislabelled.
    Greedy tokens get logprob 0, the point mass greedy decoding samples from (as the other engines).
  * Per-token versions: requests stream, and each delivered token is labelled with the receiver's version at
    delivery. Admission is closed during a load, so only `keep` lets a request cross a version boundary.
  * `kv_cache_gib` becomes SGLang's `max_total_tokens` (its KV pool size in tokens), computed from the config.
"""
import asyncio
import os
from typing import Protocol, runtime_checkable

from asyncrl.generator.engines.base import Completion, EngineOptions
from asyncrl.generator.engines.sglang_receiver import SglangWeightReceiver
from asyncrl.weightsync.dtypes import DTYPES

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@runtime_checkable
class SglangHandle(Protocol):
    """The SGLang surface this engine and its receiver (sglang_receiver.py) drive: `sglang.Engine`'s method names
    and keywords, awaitable. `AsyncSglangEngine` wraps the real engine; tests/fakes/fake_sglang.py is the fake."""

    async def async_generate(self, input_ids, sampling_params: dict, return_logprob: bool = False,
                             stream: bool = False): ...

    async def update_weights_from_tensor(self, named_tensors: list, load_format: str | None = None,
                                         flush_cache: bool = True, weight_version: str | None = None): ...

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       weight_version: str | None = None, abort_all_requests: bool = False,
                                       flush_cache: bool = True): ...

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl"): ...

    async def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | None = None): ...

    async def destroy_weights_update_group(self, group_name: str): ...

    async def pause_generation(self, mode: str = "abort"): ...

    async def continue_generation(self): ...

    async def flush_cache(self): ...

    async def get_weights_by_name(self, name: str, truncate_size: int = 100): ...

    def weight_version(self) -> str | None: ...

    def shutdown(self) -> None: ...


class SglangEngine:
    def __init__(self, options: EngineOptions):
        """`options.sglang.engine_factory(**sglang_server_args)` builds the engine handle (default: the real SGLang
        engine; tests pass the fake). `options.sglang.server_args` are extra `sglang.Engine` keywords."""
        self.options = options
        self.update_mode = options.update_mode
        self.resumed_requests = 0  # aborted-and-resubmitted requests: never here (vLLM's update_mode=abort only)
        self.engine_factory = options.sglang.engine_factory or AsyncSglangEngine
        self._engine: SglangHandle | None = None
        self.receiver: SglangWeightReceiver | None = None

    @property
    def version(self) -> int:
        return self.receiver.version if self.receiver is not None else 0

    def server_args(self) -> dict:
        """The `sglang.Engine` keywords (ServerArgs fields) this engine starts with."""
        options = self.options
        return {
            "model_path": options.model_path,
            "dtype": options.dtype,
            "context_length": options.max_model_len,
            "max_total_tokens": kv_cache_tokens(options.model_path, options.dtype, options.kv_cache_gib,
                                                options.trust_remote_code),
            "random_seed": options.seed,
            "trust_remote_code": options.trust_remote_code,
            "skip_tokenizer_init": True,  # token ids in and out: no detokenizer work on the hot path
            "log_level": "error",
            **options.sglang.server_args,
        }

    async def start(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self._engine = self.engine_factory(**self.server_args())
        self.receiver = SglangWeightReceiver(self._engine, self.update_mode, self.options.model_path,
                                             self.options.sglang.timeout_s, self.options.sglang.drain_timeout_s)

    async def sample(self, prompt_ids: list, sampling, n: int) -> list[Completion]:
        greedy = sampling.temperature == 0
        if not greedy and ((sampling.top_k or -1) > 0 or sampling.top_p < 1.0):
            raise ValueError("the sglang engine reports log_softmax(logits / temperature) before top-k/top-p, "
                             f"not the distribution sampled from; use top_k=-1 and top_p=1 (got top_k="
                             f"{sampling.top_k}, top_p={sampling.top_p}) or another engine")
        max_new_tokens = min(sampling.max_tokens, self.options.max_model_len - len(prompt_ids))
        if max_new_tokens < 1:
            return [Completion() for _ in range(n)]
        params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                  "max_new_tokens": max_new_tokens}
        return list(await asyncio.gather(*(self._one(list(prompt_ids), params, greedy) for _ in range(n))))

    async def _one(self, prompt_ids: list, params: dict, greedy: bool) -> Completion:
        completion = Completion()
        async with self.receiver.admitted():  # waits while weights are being replaced
            stream = await self._engine.async_generate(input_ids=prompt_ids, sampling_params=dict(params),
                                                       return_logprob=True, stream=True)
            finish = None
            async for chunk in stream:
                meta = chunk["meta_info"]
                version = self.receiver.version  # tokens delivered after a load carry the new version
                for logprob, token in new_tokens(meta, len(completion.token_ids)):
                    completion.token_ids.append(int(token))
                    completion.logprobs.append(0.0 if greedy else float(logprob))
                    completion.versions.append(version)
                finish = meta.get("finish_reason") or finish
        completion.finish_reason = FINISH_REASONS.get((finish or {}).get("type"), "length")
        return completion

    async def load_weights(self, staged, fallback=None) -> None:
        """A version the generator's WeightStage staged and verified, sent to SGLang with
        `update_weights_from_tensor`; a failure goes back to `fallback` (see sglang_receiver.py)."""
        await self.receiver.load_staged(staged, fallback)

    # --- versions pushed from the learner's GPU (weightsync/engine_push), driven by generator/weights.py ---

    push_kind = "sglang"
    """Which trainer side the learner opens for this engine (weightsync/engine_push/sender.py)."""

    @property
    def push_ranks(self) -> int:
        return int(self.options.sglang.server_args.get("tp_size", 1))

    @property
    def broken(self) -> str | None:
        return self.receiver.broken if self.receiver is not None else None

    def mark_broken(self, reason: str) -> None:
        self.receiver.mark_broken(reason)

    async def push_init(self, init_info: dict, transport: str = "nccl") -> None:
        """`transport` is vLLM's notion; SGLang's push is its distributed update whatever it says."""
        await self.receiver.push_join(init_info)

    async def push_begin(self) -> None:
        await self.receiver.push_begin()

    async def push_receive(self, update_info: dict, transport: str = "nccl") -> None:
        await self.receiver.push_receive(update_info)

    async def push_commit(self, version: int) -> None:
        await self.receiver.push_commit(version)

    async def push_recover(self, staged) -> None:
        await self.receiver.push_recover(staged)

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def new_tokens(meta: dict, seen: int) -> list:
    """(logprob, token id) pairs a stream chunk adds after the `seen` tokens already taken.

    `output_token_logprobs` holds (logprob, token_id, text) per token. Depending on the server's streaming
    settings it lists every token so far or only the new ones; `completion_tokens` is always the running total,
    so the new tokens are the last `completion_tokens - seen` entries either way.
    """
    entries = meta.get("output_token_logprobs") or []
    fresh = max(int(meta.get("completion_tokens", len(entries))) - seen, 0)
    return [(entry[0], entry[1]) for entry in entries[len(entries) - min(fresh, len(entries)):]]


def kv_cache_tokens(model_path: str, dtype: str, kv_cache_gib: float, trust_remote_code: bool) -> int:
    """How many tokens of K and V fit in `kv_cache_gib`: SGLang sizes its KV pool in tokens, not bytes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", None) or config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bytes_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * DTYPES[dtype].itemsize
    return max(int(kv_cache_gib * (1 << 30)) // bytes_per_token, 1)


class AsyncSglangEngine:
    """`sglang.Engine`'s methods, awaited on the caller's event loop (same names, keywords and answers).

    Each control method builds the `io_struct` request the Engine method would build and awaits the tokenizer
    manager, which answers (success, message) -- (success, message, num_paused_requests) from disk.
    """

    def __init__(self, **server_args):
        try:
            import sglang
        except ImportError as err:
            raise RuntimeError(f"generator.engine=sglang but SGLang cannot be imported ({err}); it needs CUDA "
                               "(pip install 'asyncrl[sglang]', in an environment without vLLM) -- or use "
                               "generator.engine=vllm or hf") from None
        self.engine = sglang.Engine(**server_args)
        self.tokenizer_manager = self.engine.tokenizer_manager

    async def async_generate(self, input_ids, sampling_params: dict, return_logprob: bool = False,
                             stream: bool = False):
        return await self.engine.async_generate(input_ids=input_ids, sampling_params=sampling_params,
                                                return_logprob=return_logprob, stream=stream)

    async def update_weights_from_tensor(self, named_tensors: list, load_format: str | None = None,
                                         flush_cache: bool = True, weight_version: str | None = None):
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        payload = [MultiprocessingSerializer.serialize(named_tensors)
                   for _ in range(self.engine.server_args.tp_size)]  # one copy per TP rank, as Engine does
        request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format=load_format,
                                                  flush_cache=flush_cache, weight_version=weight_version)
        return await self.tokenizer_manager.update_weights_from_tensor(request, None)

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       weight_version: str | None = None, abort_all_requests: bool = False,
                                       flush_cache: bool = True):
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        request = UpdateWeightFromDiskReqInput(model_path=model_path, load_format=load_format,
                                               weight_version=weight_version,
                                               abort_all_requests=abort_all_requests, flush_cache=flush_cache)
        return await self.tokenizer_manager.update_weights_from_disk(request, None)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl"):
        """Join the learner's torch.distributed group (rank `rank_offset` + TP rank); answers (success, message)."""
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        request = InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port,
                                                 rank_offset=rank_offset, world_size=world_size,
                                                 group_name=group_name, backend=backend)
        return await self.tokenizer_manager.init_weights_update_group(request, None)

    async def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | None = None):
        """Receive one broadcast per tensor, in `names` order, from rank 0 of the group; answers (success,
        message)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        request = UpdateWeightsFromDistributedReqInput(names=names, dtypes=dtypes, shapes=shapes,
                                                       group_name=group_name, flush_cache=flush_cache,
                                                       weight_version=weight_version)
        return await self.tokenizer_manager.update_weights_from_distributed(request, None)

    async def destroy_weights_update_group(self, group_name: str):
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

        return await self.tokenizer_manager.destroy_weights_update_group(
            DestroyWeightsUpdateGroupReqInput(group_name=group_name), None)

    async def pause_generation(self, mode: str = "abort"):
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        return await self.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=mode))

    async def continue_generation(self):
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        return await self.tokenizer_manager.continue_generation(ContinueGenerationReqInput())

    async def flush_cache(self):
        """Answers FlushCacheReqOutput; `.success` is False while any request is queued or running."""
        return await self.tokenizer_manager.flush_cache()

    async def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """The first `truncate_size` values of a parameter as the engine holds it (to check an update)."""
        from sglang.srt.managers.io_struct import GetWeightsByNameReqInput

        request = GetWeightsByNameReqInput(name=name, truncate_size=truncate_size)
        return await self.tokenizer_manager.get_weights_by_name(request, None)

    def weight_version(self) -> str | None:
        return getattr(self.tokenizer_manager.server_args, "weight_version", None)

    def shutdown(self) -> None:
        self.engine.shutdown()
