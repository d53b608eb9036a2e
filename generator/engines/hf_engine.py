"""The transformers engine: plain HF model, our own sampling loop, the same interface as the vLLM engine.

The logprob of each token is taken from exactly the distribution it was sampled from (logits / temperature, then
top-k and top-p, renormalised). Requests are batched: every `sample` call that arrives while the engine is busy, or
within `batch_wait_s` of the first, is decoded together in one left-padded batch (position ids from the attention
mask, so each row computes what it would alone). A request's prompt is prefilled once and its cache copied to its
n rows (they would compute the same), and rows that stop leave the batch, so the decode pays only for live rows:
samples of one prompt end at very different lengths. bench/generator_speed.py compares it with HF `generate` and
vLLM's CPU engine, whose per-step scheduling and IPC dominate at the demo's size. Generation runs in a worker
thread so the generator's event loop never blocks; a weight load waits for the running batch and the next one waits
for it.
"""
import asyncio
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.data.vision import suppress
from asyncrl.generator.engines.base import Completion, EngineOptions, WeightLoadError
from asyncrl.generator.engines.lora_adapter import is_lora_version, parse_adapter
from asyncrl.weightsync.lora_names import adapter_module_key


@dataclass(eq=False)
class _Request:
    prompt_ids: list
    sampling: object
    n: int
    future: asyncio.Future
    images: list | None = None


class HfEngine:
    def __init__(self, options: EngineOptions, max_batch_seqs: int = 256, batch_wait_s: float = 0.002):
        """Reads model_path, dtype, max_model_len, seed and trust_remote_code of `options`: it loads between
        batches (no update_mode) and keeps no KV cache between them (no kv_cache_gib)."""
        self.options = options
        self.dtype = getattr(torch, options.dtype)
        self.max_batch_seqs = max_batch_seqs
        self.batch_wait_s = batch_wait_s
        self.version = 0
        self.resumed_requests = 0  # aborted-and-resubmitted requests: never here (it loads between batches)
        self._generator = torch.Generator().manual_seed(options.seed)
        self._lock = asyncio.Lock()  # one batch at a time, and never during a weight load
        self._pending: list = []
        self._runner: asyncio.Task | None = None
        self.batches = 0  # decoded batches, and the sequences in them: how well requests were batched
        self.batched_seqs = 0
        self.model = None
        self.eos_token_id = None
        self.adapter = None  # the LoRA settings once a LoRA version was loaded (lora_adapter.AdapterSpec)
        self._base_shapes: dict = {}
        self.recorder = None  # with options.record_routes: the hooks that keep each forward's experts
        self.route_dtype = None
        self.vision = None  # a vision-language model's processor (data/vision.py), else None
        self.suppressed = ()  # and the placeholder tokens it never samples

    async def start(self) -> None:
        from transformers import AutoConfig

        from asyncrl.data.vision import VisionError, VisionProcessor, auto_model_class, is_vision, placeholder_tokens

        config = AutoConfig.from_pretrained(self.options.model_path, trust_remote_code=self.options.trust_remote_code)
        self.model = auto_model_class(config).from_pretrained(
            self.options.model_path, dtype=self.dtype, trust_remote_code=self.options.trust_remote_code
        ).eval()
        if is_vision(config):
            if self.options.record_routes:
                raise VisionError("learner.moe_routing_replay does not take a vision-language model")
            self.vision = VisionProcessor.from_model_dir(self.options.model_path, config)
            self.suppressed = placeholder_tokens(config)
        self._base_shapes = {name: tuple(param.shape) for name, param in self.model.named_parameters()}
        eos = self.model.generation_config.eos_token_id or self.model.config.eos_token_id
        self.eos_token_id = sorted(set(eos if isinstance(eos, list) else [eos]))
        if self.options.record_routes:
            from asyncrl.buffer.group import route_dtype
            from asyncrl.moe.routing import RouteRecorder, routing_shape

            layers, _, experts = routing_shape(self.model.config)
            self.recorder, self.route_dtype = RouteRecorder(self.model, layers), route_dtype(experts)

    async def sample(self, prompt_ids: list, sampling, n: int, images: list | None = None) -> list[Completion]:
        """`images`: a multimodal row's encoded images, one per image pad of `prompt_ids`, for a vision-language
        model (a text model refuses them rather than sample as if they were not there)."""
        if images and self.vision is None:
            raise ValueError("this row has images and the model is not a vision-language model")
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), sampling, n, future, list(images) if images else None))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run_batches())
        return await future

    async def _run_batches(self) -> None:
        """Decode pending requests until none are left. The short wait before each batch lets the other workers'
        requests, sent in the same instant, join it."""
        while self._pending:
            await asyncio.sleep(self.batch_wait_s)
            async with self._lock:
                batch = take_batch(self._pending, self.max_batch_seqs)
                if not batch:
                    continue
                try:
                    results = await asyncio.to_thread(self._sample_batch, batch)
                except Exception as err:  # every caller in the batch sees the error
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(err)
                    continue
                self.batches += 1
                self.batched_seqs += sum(request.n for request in batch)
                for request, completions in zip(batch, results):
                    if not request.future.done():  # a cancelled caller is gone
                        request.future.set_result(completions)

    @torch.no_grad()
    def _sample_batch(self, batch: list) -> list:
        sampling = batch[0].sampling  # take_batch only batches requests that sample alike
        input_ids, attention_mask, positions, extra, widths = self._prefill_inputs(batch)
        prompt_lens = [widths[index] for index, request in enumerate(batch) for _ in range(request.n)]
        limits = torch.tensor([min(sampling.max_tokens, self.options.max_model_len - width) for width in prompt_lens])
        # One prefill per request, then its cache and last logits copied to its n rows (they would compute the same)
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                            **extra)
        copies = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor([request.n for request in batch]))
        output.past_key_values.batch_select_indices(copies)
        output.logits = output.logits[copies, -1:]
        attention_mask, positions = attention_mask[copies], positions[..., copies, :]
        rows = len(prompt_lens)
        stopped = torch.zeros(rows, dtype=torch.bool)
        eos = torch.tensor(self.eos_token_id)
        live_rows = torch.arange(rows)  # the batch rows still decoding, in the order of the model's rows
        steps = max(int(limits.max()), 0)
        tokens_out = torch.zeros(rows, steps, dtype=torch.long)
        routes = RouteLog(self.recorder, input_ids.shape, rows, steps) if self.recorder is not None else None
        logprobs_out = torch.zeros(rows, steps)
        lengths = torch.zeros(rows, dtype=torch.long)
        for step in range(steps):
            logits = output.logits[:, -1].float()
            if self.vision is not None:  # a vision-language model's placeholders are never sampled
                logits = suppress(logits, self.suppressed)
            log_probs = processed_log_probs(logits, sampling)
            tokens = torch.multinomial(log_probs.exp(), 1, generator=self._generator).squeeze(-1)
            tokens_out[live_rows, step] = tokens
            logprobs_out[live_rows, step] = log_probs.gather(-1, tokens[:, None]).squeeze(-1)
            lengths[live_rows] += (limits[live_rows] > step).long()  # a prompt filling the context gets none
            # a row with no room left (a prompt filling the context) still draws this step; its draw is not its
            # completion, so an EOS there must not make it a "stop" with no token (the learner refuses that)
            hit_eos = torch.isin(tokens, eos) & (limits[live_rows] > step)
            stopped[live_rows[hit_eos]] = True
            done = hit_eos | (limits[live_rows] <= step + 1)
            if bool(done.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones(len(live_rows), 1, dtype=attention_mask.dtype)],
                                       dim=1)
            positions = positions[..., -1:] + 1  # after its prompt every row's M-RoPE rows advance as one
            cache = output.past_key_values
            if bool(done.any()):  # finished rows leave the batch: the rest decode without them
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live_rows, tokens = live_rows[keep], tokens[keep]
                attention_mask, positions = attention_mask[keep], positions[..., keep, :]
            output = self.model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=positions,
                                past_key_values=cache, use_cache=True)
            if routes is not None:
                routes.decoded(live_rows, step)
        completions = [Completion() for _ in range(rows)]
        tokens, logprobs, lengths = tokens_out.tolist(), logprobs_out.tolist(), lengths.tolist()
        for row, completion in enumerate(completions):
            completion.token_ids = tokens[row][:lengths[row]]
            completion.logprobs = logprobs[row][:lengths[row]]
            completion.versions = [self.version] * lengths[row]
        for row, completion in enumerate(completions):
            completion.finish_reason = "stop" if bool(stopped[row]) else "length"
            if routes is not None:
                completion.routed_experts = routes.of(row, int(copies[row]), prompt_lens[row], lengths[row],
                                                      self.route_dtype)
        results, start = [], 0
        for request in batch:
            results.append(completions[start:start + request.n])
            start += request.n
        return results

    def _prefill_inputs(self, batch: list) -> tuple:
        """(input ids, mask, positions, the forward's other inputs, each request's prompt width) of a batch's
        left-padded prompts. A vision-language model's prompts are widened to their images' patches and take the
        model's M-RoPE positions [3, rows, width] with the images' pixels; a text model's positions are [rows,
        width], counted from each row's first token."""
        if self.vision is None:
            input_ids, attention_mask = left_pad([request.prompt_ids for request in batch])
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            return input_ids, attention_mask, positions, {}, [len(request.prompt_ids) for request in batch]
        from asyncrl.data.vision import rope_positions

        prompts, pixels, grids = [], [], []
        for request in batch:
            if request.images:
                inputs = self.vision.process(request.images)
                prompts.append(self.vision.widen(request.prompt_ids, inputs))
                pixels.append(inputs.pixel_values)
                grids.append(inputs.image_grid_thw)
            else:
                prompts.append(request.prompt_ids)
        input_ids, attention_mask = left_pad(prompts)
        grid = torch.cat(grids) if grids else None
        positions = rope_positions(self.model, input_ids, attention_mask, grid)
        extra = {"pixel_values": torch.cat(pixels).to(self.dtype), "image_grid_thw": grid} if pixels else {}
        return input_ids, attention_mask, positions, extra, [len(prompt) for prompt in prompts]

    async def load_weights(self, staged, fallback=None) -> None:
        """Copy the staged tensors in under the lock, so no batch ever sees a partly loaded model. Names and shapes
        are checked before the first copy; should a copy still fail midway, `fallback` (the last good staged
        version, or the model's own files) is copied back before the lock is released. A LoRA version goes into
        adapters injected into the model (load_adapter)."""
        if is_lora_version(staged.announcement):
            return await self.load_adapter(staged)
        async with self._lock:
            if self.adapter is not None:
                raise WeightLoadError(f"v{staged.version} is a full version and this engine serves LoRA adapters "
                                      f"(the learner restarted without learner.lora?): restart the generator")
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

    async def load_adapter(self, staged) -> None:
        """A LoRA version: on the first, peft's adapters are injected into the model with its settings (the base
        weights stay the model's own); every version then copies its adapter tensors in, under the lock. A version
        whose rank or targets differ from the injected ones is refused."""
        spec = parse_adapter(staged.announcement, self._base_shapes)
        async with self._lock:
            if self.adapter is None:
                from peft import LoraConfig, inject_adapter_in_model

                inject_adapter_in_model(LoraConfig(r=spec.rank, lora_alpha=spec.alpha, bias="none",
                                                   target_modules=list(spec.target_modules)), self.model)
                self.adapter = spec
            elif spec != self.adapter:
                raise WeightLoadError(f"v{staged.version} is a rank-{spec.rank} adapter on {spec.target_modules}; "
                                      f"this engine serves rank {self.adapter.rank} on {self.adapter.target_modules}")
            params = dict(self.model.named_parameters())
            tensors = {adapter_module_key(name): tensor for name, tensor in staged.buckets.tensors()}
            unknown = [key for key in tensors if key not in params]
            if unknown:
                raise WeightLoadError(f"v{staged.version}: adapter tensors {unknown[:3]} fit no injected layer")
            self._copy_in(params, tensors)
            self.version = staged.version

    @torch.no_grad()
    def _copy_in(self, params: dict, tensors: dict) -> None:
        for name, tensor in tensors.items():
            params[name].copy_(tensor)

    def _original(self) -> dict:
        return type(self.model).from_pretrained(self.options.model_path, dtype=self.dtype,
                                                trust_remote_code=self.options.trust_remote_code).state_dict()

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        for request in self._pending:
            request.future.cancel()
        self._pending.clear()
        self.model = None


class RouteLog:
    """The experts of one batch's forwards (learner.moe_routing_replay): the prefill's, one row per request over its
    left-padded prompt, then each decode step's, at the batch rows that ran it; `of` puts a completion's together in
    Sample.routed_experts's layout (every position the model ran, prompt and completion but the last token)."""

    def __init__(self, recorder, prompt_shape: tuple, rows: int, steps: int):
        self.recorder = recorder
        self.prompts = recorder.chosen(*prompt_shape).to(torch.int16)  # [requests, width, layers, top_k]
        self.decode = torch.zeros(rows, steps, *self.prompts.shape[2:], dtype=torch.int16)  # [rows, steps, ...]

    def decoded(self, live_rows: torch.Tensor, step: int) -> None:
        self.decode[live_rows, step] = self.recorder.chosen(len(live_rows), 1)[:, 0].to(torch.int16)

    def of(self, row: int, request: int, prompt_len: int, length: int, dtype) -> np.ndarray:
        """[prompt_len + length - 1, layers, top_k] of batch row `row` (request `request`'s copy)."""
        prompt = self.prompts[request, self.prompts.shape[1] - prompt_len:]
        return torch.cat([prompt, self.decode[row, :max(length - 1, 0)]])[:prompt_len + length - 1].numpy().astype(
            dtype)


def take_batch(pending: list, max_seqs: int) -> list:
    """Remove and return the oldest waiting request and every later one that samples alike, up to `max_seqs`
    sequences (the oldest is taken even if it alone is larger: it is never starved). Requests that sample
    differently (the greedy ReMax baseline) wait for the next batch; those whose caller is gone are dropped."""
    pending[:] = [request for request in pending if not request.future.done()]
    if not pending:
        return []
    sampling = pending[0].sampling
    batch, kept, seqs = [], [], 0
    for request in pending:
        if request.sampling == sampling and (not batch or seqs + request.n <= max_seqs):
            batch.append(request)
            seqs += request.n
        else:
            kept.append(request)
    pending[:] = kept
    return batch


def left_pad(prompts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), prompts aligned on the right so every row's next token is the last column."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


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
