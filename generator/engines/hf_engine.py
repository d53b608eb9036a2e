"""The reference engine: plain transformers with our own sampling loop, the same interface as the vLLM engine.

It is slow but transparent: the logprob of each token is taken from exactly the distribution it was sampled from
(logits / temperature, then top-k and top-p, renormalised). It is the fallback when vLLM is not installed.
Generation runs in a worker thread so the generator's event loop never blocks.
"""
import asyncio

import torch

from asyncrl.generator.engines.base import Completion, WeightLoadError


class HfEngine:
    def __init__(self, model_path: str, dtype: str, max_model_len: int, kv_cache_gib: float, seed: int,
                 update_mode: str = "wait", trust_remote_code: bool = False):
        self.model_path = model_path
        self.dtype = getattr(torch, dtype)
        self.max_model_len = max_model_len
        self.trust_remote_code = trust_remote_code
        self.version = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = asyncio.Lock()  # one batch at a time, and never during a weight load
        self.model = None
        self.eos_token_id = None

    async def start(self) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.dtype, trust_remote_code=self.trust_remote_code
        ).eval()
        eos = self.model.generation_config.eos_token_id or self.model.config.eos_token_id
        self.eos_token_id = set(eos if isinstance(eos, list) else [eos])

    async def sample(self, prompt_ids: list, sampling, n: int) -> list[Completion]:
        async with self._lock:
            return await asyncio.to_thread(self._sample, list(prompt_ids), sampling, n)

    @torch.no_grad()
    def _sample(self, prompt_ids: list, sampling, n: int) -> list[Completion]:
        max_tokens = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        completions = [Completion() for _ in range(n)]
        input_ids = torch.tensor([prompt_ids] * n)
        output = self.model(input_ids=input_ids, use_cache=True)
        finished = torch.zeros(n, dtype=torch.bool)
        for _ in range(max_tokens):
            log_probs = processed_log_probs(output.logits[:, -1].float(), sampling)
            tokens = torch.multinomial(log_probs.exp(), 1, generator=self._generator).squeeze(-1)
            chosen = log_probs.gather(-1, tokens[:, None]).squeeze(-1)
            for row in range(n):
                if finished[row]:
                    continue
                completion = completions[row]
                completion.token_ids.append(int(tokens[row]))
                completion.logprobs.append(float(chosen[row]))
                completion.versions.append(self.version)
                if int(tokens[row]) in self.eos_token_id:
                    finished[row] = True
                    completion.finish_reason = "stop"
            if bool(finished.all()):
                break
            output = self.model(input_ids=tokens[:, None], past_key_values=output.past_key_values, use_cache=True)
        return completions

    async def load_weights(self, staged, fallback=None) -> None:
        """Copy the staged tensors in under the lock, so no batch ever sees a partly loaded model. Names and shapes
        are checked before the first copy; should a copy still fail midway, `fallback` (the last good staged
        version, or the model's own files) is copied back before the lock is released."""
        async with self._lock:
            tensors = dict(staged.buckets.tensors())
            params = dict(self.model.named_parameters(remove_duplicate=False))
            missing = [name for name in params if name not in tensors and not _is_tied(self.model, name)]
            unknown = [name for name in tensors if name not in params]
            bad_shape = [n for n, t in tensors.items() if n in params and params[n].shape != t.shape]
            if missing or unknown or bad_shape:  # checked before any copy: never half-loaded
                raise WeightLoadError(
                    f"v{staged.version}: missing {missing[:3]}, unknown {unknown[:3]}, wrong shape {bad_shape[:3]}")
            try:
                self._copy_in(params, tensors)
            except Exception as err:
                self._copy_in(params, dict(fallback.buckets.tensors()) if fallback else self._original())
                raise WeightLoadError(f"hf engine could not load v{staged.version}: {err}; kept v{self.version}") \
                    from err
            self.version = staged.version

    @torch.no_grad()
    def _copy_in(self, params: dict, tensors: dict) -> None:
        for name, tensor in tensors.items():
            params[name].copy_(tensor)

    def _original(self) -> dict:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype,
                                                    trust_remote_code=self.trust_remote_code).state_dict()

    async def close(self) -> None:
        self.model = None


def _is_tied(model, name: str) -> bool:
    output = model.get_output_embeddings()
    return output is not None and name.endswith("lm_head.weight") and output.weight is model.get_input_embeddings().weight


def processed_log_probs(logits: torch.Tensor, sampling) -> torch.Tensor:
    """log of the distribution actually sampled from: temperature, then top-k, then top-p, renormalised.

    Temperature 0 is greedy decoding (ReMax baselines): a point mass on the argmax, as vLLM does.
    """
    if sampling.temperature == 0:
        greedy = torch.full_like(logits, float("-inf"))
        return greedy.scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > sampling.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.log_softmax(-1)
