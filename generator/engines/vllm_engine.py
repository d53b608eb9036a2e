"""vLLM engine through `AsyncLLM`: streaming deltas, token ids in and out, processed logprobs.

Weight updates follow platform_notes.md: pause -> `reload_weights` on every worker (the only way that works after
CPU weight prepacking) -> `reset_prefix_cache` (otherwise cached KV from old weights is reused) -> resume. A
failed reload is followed by a reload of the last good file, because a half-loaded CPU engine dies on its next
generate.
"""
import asyncio
import os
import uuid

from asyncrl.generator.engines.base import Completion, WeightLoadError


class VllmEngine:
    def __init__(self, model_path: str, dtype: str, max_model_len: int, kv_cache_gib: float, seed: int,
                 update_mode: str = "wait", trust_remote_code: bool = False):
        self.model_path = model_path
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.seed = seed
        self.update_mode = update_mode
        self.trust_remote_code = trust_remote_code
        self.version = 0
        self._good_dir = model_path  # the directory of the last weights that loaded
        self._engine = None
        self._loaded = asyncio.Event()
        self._loaded.set()

    async def start(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=int(self.kv_cache_gib * (1 << 30)),
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            disable_log_stats=True,
        )
        self._engine = AsyncLLM.from_engine_args(args)

    async def sample(self, prompt_ids: list, sampling, n: int) -> list[Completion]:
        await self._loaded.wait()  # never start a request while weights are being replaced
        return list(await asyncio.gather(*(self._one(prompt_ids, sampling) for _ in range(n))))

    async def _one(self, prompt_ids: list, sampling) -> Completion:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, logprobs=0, output_kind=RequestOutputKind.DELTA,
        )
        completion = Completion()
        async for output in self._engine.generate({"prompt_token_ids": list(prompt_ids)}, params,
                                                  request_id=uuid.uuid4().hex):
            delta = output.outputs[0]
            version = self.version  # tokens delivered after a load carry the new version
            # A greedy request (temperature 0, the ReMax baseline) may come back without logprobs: its tokens
            # are kept with logprob 0, the log-probability of the point mass greedy decoding samples from.
            logprobs = delta.logprobs or [None] * len(delta.token_ids)
            for token, logprob_dict in zip(delta.token_ids, logprobs):
                completion.token_ids.append(token)
                completion.logprobs.append(logprob_dict[token].logprob if logprob_dict else 0.0)
                completion.versions.append(version)
            if delta.finish_reason is not None:
                completion.finish_reason = "stop" if delta.finish_reason == "stop" else (
                    "abort" if delta.finish_reason == "abort" else "length")
        return completion

    async def load_weights(self, path: str, version: int) -> None:
        """Pause, load the whole file, reset the prefix cache, resume. On failure reload the last good file."""
        self._loaded.clear()
        await self._engine.pause_generation(mode=self.update_mode, clear_cache=True)
        try:
            await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": os.path.dirname(path)})
        except Exception as err:
            await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": self._good_dir})
            await self._engine.reset_prefix_cache()
            await self._engine.resume_generation()
            self._loaded.set()
            raise WeightLoadError(f"vLLM could not load v{version} from {path}: {err}; kept v{self.version}") from err
        await self._engine.reset_prefix_cache()
        self.version = version
        self._good_dir = os.path.dirname(path)
        await self._engine.resume_generation()
        self._loaded.set()

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
