"""A faithful fake of the SGLang engine surface the sglang engine drives (`sglang_engine.SglangHandle`, which
`AsyncSglangEngine` implements for the real engine).

Same method names, keywords and answers as SGLang 0.5.x: control calls answer (success, message), a disk load
(success, message, num_paused_requests), `flush_cache` a FlushCacheReqOutput; `async_generate` answers dicts
with `output_ids` and `meta_info` {finish_reason: {"type": ...}, completion_tokens, output_token_logprobs:
[(logprob, token_id, None)], weight_version}, cumulative per chunk (incremental with
`incremental_streaming_output=True`).

The model is two tensors (embedding and head) in a dict: the next token's logits are head @ embed[last token].
What it simulates, because the receiver's safety depends on it:
  * logprobs as SGLang reports them: log_softmax(logits / T) of the sampled token, before top-k/top-p (which only
    shape the draw); raw log_softmax for greedy.
  * pause modes: `abort` ends running requests with finish_reason abort and returns once none is left;
    `retract` and `in_place` keep them, frozen. New requests wait while paused, as the tokenizer manager's do.
  * `flush_cache` fails while any request is queued or running; an update with flush_cache=True that cannot
    flush kills the scheduler (SGLang asserts "Cache flush failed after updating weights").
  * a tensor load that stops midway: `fail_update_after = k` writes k tensors and then answers failure, and so
    does a tensor the model has no parameter for; the weights are left half written, and generating from them
    raises (the real engine would serve garbage or crash) until a full load replaces them. Unpaused, a load
    waits for running requests first (it takes SGLang's model-update lock).
  * a slow load: `update_delay_s` is how long a tensor load takes, so a test can run one past a timeout.
  * every control call is recorded in `calls`, in order, as (method, keywords).
  * the distributed path as SGLang's workers run it: `init_weights_update_group` joins the trainer's group (gloo
    here, NCCL there), `update_weights_from_distributed` receives one broadcast per tensor in `names` order into
    fresh tensors, then loads them.
Not simulated: how a real load fails (SGLang 0.5.x's `update_weights_from_tensor` answers (True, "Success") or
raises inside the scheduler, which takes the engine down; the fake answers (False, message) so the receiver's
rollback can be driven), the serialization of the tensors to the scheduler, tensor parallelism, and the radix
cache's contents (only whether a flush may run).
"""
import asyncio
import os
import uuid
from dataclasses import dataclass

import torch

VOCAB, HIDDEN, EOS = 16, 8, 0
WEIGHTS_FILE = "model.safetensors"
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


def initial_weights(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator),
            "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=generator)}


def write_checkpoint(directory: str, weights: dict) -> str:
    """Save `weights` as the directory's model.safetensors (what update_weights_from_disk reads)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, os.path.join(directory, WEIGHTS_FILE))
    return directory


class FakeSglangEngine:
    def __init__(self, **server_args):
        self.server_args = server_args
        checkpoint = os.path.join(server_args["model_path"], WEIGHTS_FILE)
        self.weights = _load(checkpoint) if os.path.isfile(checkpoint) else initial_weights(
            server_args.get("random_seed", 0))
        self._weight_version = "default"  # ServerArgs.weight_version's default
        self._generator = torch.Generator().manual_seed(server_args.get("random_seed", 0))
        self.calls: list = []
        self.paused = False
        self.partial: str | None = None  # why the weights are half written
        self.dead: str | None = None  # why the scheduler died
        self.requests: dict = {}  # rid -> {"state": running|retracted, "aborted": bool}
        self.fail_update_after: int | None = None
        self.update_delay_s = 0.0  # how long a tensor load takes, so a test can run one past a timeout
        self.fail_disk_load = False
        self.step_delay_s = 0.0  # time per decode step, so tests can act while a request runs
        self.tokens_served: list = []  # (weight_version, token) of every token generated
        self.update_groups: dict = {}  # group name -> the torch.distributed group joined for weight updates

    # --- generation ---------------------------------------------------------------------------------------

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             stream=False):
        if prompt is not None:
            raise ValueError("skip_tokenizer_init=True: send input_ids, not text")
        if not input_ids or not all(isinstance(token, int) for token in input_ids):
            raise ValueError(f"the fake takes one prompt of token ids, got {input_ids!r}")
        params = _check_sampling(dict(sampling_params or {}))
        while self.paused:  # the tokenizer manager holds new requests while paused
            await asyncio.sleep(0.001)
        chunks = self._generate(uuid.uuid4().hex, list(input_ids), params, return_logprob)
        if stream:
            return chunks
        last = None
        async for last in chunks:
            pass
        return last

    async def _generate(self, rid: str, prompt: list, params: dict, return_logprob: bool):
        request = self.requests[rid] = {"state": "running", "aborted": False}
        incremental = self.server_args.get("incremental_streaming_output", False)
        output, entries, sent = [], [], 0
        try:
            finish = {"type": "length", "length": 0} if params["max_new_tokens"] == 0 else None
            while finish is None:
                await asyncio.sleep(self.step_delay_s)  # one decode step; control calls interleave here
                while self.paused and not request["aborted"]:
                    await asyncio.sleep(0.001)
                if request["aborted"]:
                    finish = {"type": "abort", "message": "Abort in waiting queue"}
                    break
                if self.dead or self.partial:
                    raise RuntimeError(f"fake sglang cannot run a forward: {self.dead or self.partial}")
                token, logprob = self._next_token((prompt + output)[-1], params)
                output.append(token)
                entries.append((logprob, token, None))
                self.tokens_served.append((self._weight_version, token))
                if token == EOS and not params.get("ignore_eos"):
                    finish = {"type": "stop", "matched": EOS}
                elif len(output) == params["max_new_tokens"]:
                    finish = {"type": "length", "length": len(output)}
                if finish is None:
                    yield self._chunk(rid, prompt, output, entries, None, sent if incremental else 0,
                                      return_logprob)
                    sent = len(output)
            yield self._chunk(rid, prompt, output, entries, finish, sent if incremental else 0, return_logprob)
        finally:
            self.requests.pop(rid, None)

    def _chunk(self, rid, prompt, output, entries, finish, start, return_logprob) -> dict:
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(output),
                "cached_tokens": 0, "weight_version": self._weight_version}
        if return_logprob:
            meta["output_token_logprobs"] = list(entries[start:])
        return {"text": "", "output_ids": list(output[start:]), "meta_info": meta}

    def _next_token(self, last: int, params: dict) -> tuple:
        logits = self.weights["lm_head.weight"].float() @ self.weights["model.embed_tokens.weight"][last].float()
        if params["temperature"] == 0:
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, -1)[token])
        scaled = logits / params["temperature"]
        probs = torch.softmax(scaled, -1)
        if params["top_k"] > 0:  # filters shape the draw only: SGLang reports the unfiltered logprob
            probs = probs.masked_fill(probs < torch.topk(probs, min(params["top_k"], VOCAB)).values[-1], 0.0)
        if params["top_p"] < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            drop = (ordered.cumsum(-1) - ordered) > params["top_p"] * ordered.sum()
            probs = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
        token = int(torch.multinomial(probs / probs.sum(), 1, generator=self._generator))
        return token, float(torch.log_softmax(scaled, -1)[token])

    # --- pause, continue, cache ---------------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort"):
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        self.calls.append(("pause_generation", {"mode": mode}))
        self.paused = True
        if mode == "abort":
            self._abort_all()
            await self._wait_no_requests()  # SGLang returns once every aborted request has come back
        elif mode == "retract":
            for request in self.requests.values():
                request["state"] = "retracted"

    async def continue_generation(self):
        self.calls.append(("continue_generation", {}))
        self.paused = False
        for request in self.requests.values():
            request["state"] = "running"

    async def flush_cache(self):
        self.calls.append(("flush_cache", {}))
        return FlushCacheReqOutput(success=self._flush())

    def _flush(self) -> bool:
        return not self.requests  # SGLang flushes only with no queued and no running request

    def _abort_all(self) -> None:
        for request in self.requests.values():
            request["aborted"] = True

    async def _wait_no_requests(self) -> None:
        while self.requests:
            await asyncio.sleep(0.001)

    # --- weight updates -----------------------------------------------------------------------------------

    async def update_weights_from_tensor(self, named_tensors: list, load_format: str | None = None,
                                         flush_cache: bool = True, weight_version: str | None = None):
        self.calls.append(("update_weights_from_tensor", {
            "names": [name for name, _ in named_tensors], "flush_cache": flush_cache,
            "weight_version": weight_version, "paused": self.paused}))
        if not self.paused:  # unpaused, the update takes the model-update lock: running requests finish first
            await self._wait_no_requests()
        await asyncio.sleep(self.update_delay_s)
        for written, (name, tensor) in enumerate(named_tensors):
            if written == self.fail_update_after or name not in self.weights:
                self.fail_update_after = None
                self.partial = f"{written} of {len(named_tensors)} tensors written"
                return False, f"Failed to update weights: stopped at {name}; the weights are partially updated."
            self.weights[name] = tensor.clone()
        if {name for name, _ in named_tensors} >= set(self.weights):
            self.partial = None  # every parameter replaced: nothing half written is left
        return self._finish_update(weight_version, flush_cache, "Success")

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       weight_version: str | None = None, abort_all_requests: bool = False,
                                       flush_cache: bool = True):
        self.calls.append(("update_weights_from_disk", {
            "model_path": model_path, "weight_version": weight_version, "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache}))
        if abort_all_requests:
            self._abort_all()
        await self._wait_no_requests()  # the disk load takes the model-update lock
        checkpoint = os.path.join(model_path, WEIGHTS_FILE)
        if self.fail_disk_load or not os.path.isfile(checkpoint):
            return False, f"Failed to get weights iterator: {checkpoint} could not be read", 0
        tensors = _load(checkpoint)
        if set(tensors) != set(self.weights):
            return False, f"Failed to load {checkpoint}: names differ from the model's", 0
        self.weights, self.partial = tensors, None
        success, message = self._finish_update(weight_version, flush_cache, "Succeeded to update model weights.")
        return success, message, 0

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl"):
        """As SGLang's workers: join the trainer's group as rank `rank_offset` (+ TP rank 0) through a TCP
        rendezvous, under the group's name. The fake takes backend="gloo" (a CPU test); SGLang takes nccl."""
        self.calls.append(("init_weights_update_group", {"master_port": master_port, "rank_offset": rank_offset,
                                                         "world_size": world_size, "group_name": group_name}))
        try:
            group = await asyncio.to_thread(join_weights_group, master_address, master_port, rank_offset,
                                            world_size, group_name, backend)
        except Exception as err:  # noqa: BLE001 - SGLang answers failures, it does not raise them
            return False, f"Failed to init process group: {err}"
        self.update_groups[group_name] = group
        return True, "Succeeded to initialize custom process group."

    async def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | None = None):
        """As SGLang's model runner: a fresh tensor per name, one broadcast from rank 0 each (in `names` order),
        all awaited, then loaded. A name the model lacks fails after the receive, leaving nothing written."""
        self.calls.append(("update_weights_from_distributed", {
            "names": list(names), "dtypes": list(dtypes), "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": weight_version, "paused": self.paused}))
        group = self.update_groups.get(group_name)
        if group is None:
            return False, f"Group {group_name} not in {list(self.update_groups)}. Please call init first."
        received = [(name, torch.empty(shape, dtype=getattr(torch, dtype)))
                    for name, dtype, shape in zip(names, dtypes, shapes)]

        def receive():
            for work in [group.broadcast(tensor, 0) for _, tensor in received]:
                work.wait()

        try:
            await asyncio.to_thread(receive)
        except Exception as err:  # noqa: BLE001
            return False, f"Failed to update parameter online: {err}. The full weights of the ModelRunner are " \
                          f"partially updated."
        unknown = [name for name, _ in received if name not in self.weights]
        if unknown:
            return False, f"Failed to update parameter online: no parameter {unknown[0]}"
        for name, tensor in received:
            self.weights[name] = tensor
        return self._finish_update(weight_version, flush_cache, "Succeeded to update parameter online.")

    async def destroy_weights_update_group(self, group_name: str):
        group = self.update_groups.pop(group_name, None)
        if group is None:
            return False, f"Group {group_name} not found"
        return True, "Succeeded to destroy custom process group."

    def _finish_update(self, weight_version, flush_cache: bool, message: str) -> tuple:
        if weight_version is not None:
            self._weight_version = weight_version
        if flush_cache:
            self.calls.append(("flush_cache", {"after_update": True}))
            if not self._flush():
                self.dead = "scheduler died: AssertionError: Cache flush failed after updating weights"
                raise RuntimeError(self.dead)
        return True, message

    async def get_weights_by_name(self, name: str, truncate_size: int = 100):
        return self.weights[name].flatten()[:truncate_size].tolist()

    def weight_version(self) -> str:
        return self._weight_version

    def shutdown(self) -> None:
        self.calls.append(("shutdown", {}))
        self.dead = "shut down"


def join_weights_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                       backend: str, timeout_s: float = 60.0):
    """One rank of a weight-update group over a TCP rendezvous at master_address:master_port (rank 0 hosts the
    store), keyed by the group's name; the CPU tests' stand-in for SGLang's `init_custom_process_group`, and with
    rank 0 for the learner's side of it."""
    import datetime

    import torch.distributed as dist

    if backend != "gloo":
        raise ValueError(f"the fake joins gloo groups only, not {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank, world_size, timeout)


def _load(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def _check_sampling(params: dict) -> dict:
    """SGLang's SamplingParams defaults and checks for the fields the engine sends."""
    params.setdefault("temperature", 1.0)
    params.setdefault("top_p", 1.0)
    params.setdefault("top_k", -1)
    params.setdefault("max_new_tokens", 128)
    if params["temperature"] < 0 or not 0 < params["top_p"] <= 1:
        raise ValueError(f"bad temperature/top_p: {params}")
    if params["top_k"] < -1 or params["top_k"] == 0:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {params['top_k']}")
    return params
