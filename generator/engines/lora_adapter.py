"""LoRA versions on the generator side: a version published by a LoRA learner (learner/lora.py) carries only the
adapter, named as PEFT's adapter files name it, and a `lora` entry with its rank, alpha and target modules. The
engines serve it on the base model they already hold: vLLM as an adapter of its own per version (written as a PEFT
directory and added with `add_lora`), the hf engine by copying it into adapters injected into its model.

The message comes from another machine: everything in it is checked here before any engine sees it (rank, alpha,
module names, and every tensor's name and shape against the rank and the base model's layers)."""
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass

from asyncrl.generator.engines.base import WeightLoadError
from asyncrl.weightsync.lora_names import ADAPTER_NAME, adapter_module_key

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for max_lora_rank (its LoRAConfig)."""
log = logging.getLogger(__name__)
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    target_modules: tuple

    def adapter_config(self, base_model: str) -> dict:
        """PEFT's adapter_config.json for this adapter (the fields vLLM's loader reads)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": 0.0, "bias": "none",
                "target_modules": list(self.target_modules), "fan_in_fan_out": False, "use_rslora": False,
                "modules_to_save": None}


def is_lora_version(message) -> bool:
    """`message` (a weightsync WeightsAnnouncement) announces a LoRA adapter rather than a full version."""
    return message.lora is not None


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above what vLLM serves ({VLLM_LORA_RANKS[-1]})")


def parse_adapter(message, base_shapes: dict, max_rank: int | None = None) -> AdapterSpec:
    """The adapter a LoRA version's announcement describes, checked against the base model's weight shapes
    (`base_shapes`: plain module key -> shape, e.g. `model.layers.0.self_attn.q_proj.weight`), or WeightLoadError
    saying what does not fit. `max_rank`: the most the engine was started for."""
    version = message.version
    lora = message.lora
    if not isinstance(lora, dict):
        raise WeightLoadError(f"v{version}: the `lora` entry of the announcement is not a mapping")
    rank, alpha, targets = lora.get("r"), lora.get("lora_alpha"), lora.get("target_modules")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 512:
        raise WeightLoadError(f"v{version}: LoRA rank {rank!r} is not an integer in [1, 512]")
    if max_rank is not None and rank > max_rank:
        raise WeightLoadError(f"v{version}: LoRA rank {rank} is above the engine's max_lora_rank {max_rank} (the "
                              f"generator's recipe has another learner.lora.rank than the learner's)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise WeightLoadError(f"v{version}: LoRA alpha {alpha!r} is not a positive number")
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(name, str) and _MODULE_NAME.match(name) for name in targets)):
        raise WeightLoadError(f"v{version}: LoRA target_modules {targets!r} is not a list of module names")
    problems, sent = [], set()
    for name, shape in zip(message.names, message.shapes):
        try:
            key = adapter_module_key(name)
        except ValueError as err:
            problems.append(str(err))
            continue
        sent.add(key)
        stem, which = key.split(".lora_")[0], key.split(".lora_")[1][0]
        base = base_shapes.get(f"{stem}.weight")
        if base is None or stem.rsplit(".", 1)[-1] not in targets:
            problems.append(f"{name!r} adapts no target layer of the base model")
            continue
        want = (rank, base[1]) if which == "A" else (base[0], rank)
        if tuple(shape) != want:
            problems.append(f"{name!r} has shape {tuple(shape)}, rank {rank} on {tuple(base)} needs {want}")
    expected = {f"{key[:-len('.weight')]}.lora_{which}.{ADAPTER_NAME}.weight"
                for key in base_shapes if key.endswith(".weight") and key.split(".")[-2] in targets
                for which in "AB"}
    missing = sorted(expected - sent)
    if missing:  # a layer left out would keep serving the older adapter's (or no) update: a mixed policy
        problems.append(f"{len(missing)} adapter tensors are missing, e.g. {missing[0]!r}")
    if problems:
        raise WeightLoadError(f"v{version} is not an adapter of this model: {'; '.join(problems[:3])}")
    return AdapterSpec(rank, float(alpha), tuple(targets))


def write_adapter_dir(directory: str, staged, spec: AdapterSpec, base_model: str) -> str:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) for a staged LoRA version: the
    form vLLM loads adapters from. The tensors are copied out, since the staging slot is reused."""
    from safetensors.torch import save_file

    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({name: tensor.clone() for name, tensor in staged.buckets.tensors()},
              os.path.join(tmp, "adapter_model.safetensors"))
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(spec.adapter_config(base_model), f)
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(tmp, directory)
    return directory


@dataclass
class ServedAdapter:
    version: int
    publisher: str
    lora_id: int
    request: object  # vllm.lora.request.LoRARequest
    path: str


class ServedAdapters:
    """The LoRA versions a vLLM engine holds, one adapter each. A request takes the newest when it starts and keeps
    it to its end, so loading a version never pauses the engine nor mixes two versions in one completion
    (generator.update_mode has nothing to decide). The newest `keep` (buffer.max_staleness + 1: every version the
    buffer still admits) stay loaded, and an older one only while a request runs on it; then it is removed from
    the engine and its directory deleted.

    `add(request)` / `remove(lora_id)`: the engine's `add_lora` and `remove_lora` coroutines; `make_request(name,
    lora_id, path)`: vLLM's LoRARequest (a plain factory keeps this class free of vLLM for its unit tests)."""

    def __init__(self, add, remove, make_request, base_model: str, base_shapes: dict, max_rank: int, keep: int,
                 root: str | None = None):
        self.add, self.remove, self.make_request = add, remove, make_request
        self.base_model, self.base_shapes, self.max_rank, self.keep = base_model, base_shapes, max_rank, keep
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.root = root or tempfile.mkdtemp(prefix="asyncrl-lora-", dir=shm)
        self.loaded: list[ServedAdapter] = []  # oldest first
        self.base_only = False  # a full version replaced the base model: no adapter applies to it
        self.in_use: Counter = Counter()  # lora id -> requests running on it
        self.next_id = 1

    @property
    def current(self) -> ServedAdapter | None:
        return self.loaded[-1] if self.loaded and not self.base_only else None

    async def load(self, staged) -> ServedAdapter:
        """Add `staged` (a checked LoRA version) as the adapter new requests take; WeightLoadError leaves the
        current one serving. A version already loaded (an evaluation round pinned to it) is taken again."""
        publisher = staged.announcement.publisher
        for served in self.loaded:
            if served.version == staged.version and served.publisher == publisher and not self.base_only:
                self.loaded.remove(served)
                self.loaded.append(served)
                return served
        spec = parse_adapter(staged.announcement, self.base_shapes, self.max_rank)
        lora_id, self.next_id = self.next_id, self.next_id + 1
        path = write_adapter_dir(os.path.join(self.root, f"v{int(staged.version)}-{lora_id}"), staged, spec,
                                 self.base_model)
        request = self.make_request(f"asyncrl-v{staged.version}-{lora_id}", lora_id, path)
        try:
            added = await self.add(request)
        except Exception as err:  # noqa: BLE001 - whatever vLLM raised, the old adapter still serves
            added, why = False, f"{type(err).__name__}: {err}"
        else:
            why = "add_lora returned False"
        if not added:
            shutil.rmtree(path, ignore_errors=True)
            raise WeightLoadError(f"vLLM could not add v{staged.version} as a LoRA adapter ({why})")
        served = ServedAdapter(staged.version, publisher, lora_id, request, path)
        self.base_only = False
        self.loaded.append(served)
        await self.prune()
        return served

    async def replaced_base(self) -> None:
        """A full version was loaded (a learner that publishes full weights): new requests sample it without an
        adapter, and every adapter goes once no request runs on it (they were trained on the old base)."""
        self.base_only = True
        await self.prune()

    def acquire(self) -> ServedAdapter | None:
        """The adapter a starting request samples with (None before any LoRA version: the base model)."""
        served = self.current
        if served is not None:
            self.in_use[served.lora_id] += 1
        return served

    async def release(self, served: ServedAdapter | None) -> None:
        if served is None:
            return
        self.in_use[served.lora_id] -= 1
        if self.in_use[served.lora_id] <= 0:
            del self.in_use[served.lora_id]
        try:
            await self.prune()
        except Exception as err:  # noqa: BLE001 - a request's end must not fail on the cleanup of another version
            log.warning("LoRA: could not remove an old adapter (%s: %s); it stays loaded", type(err).__name__, err)

    async def prune(self) -> None:
        """Remove every adapter older than the newest `keep` (every one, after replaced_base) that no request runs
        on."""
        for served in list(self.loaded if self.base_only else self.loaded[:-self.keep]):
            if self.in_use.get(served.lora_id) or served not in self.loaded:  # in use, or a concurrent prune's
                continue
            self.loaded.remove(served)
            try:
                await self.remove(served.lora_id)
            finally:
                shutil.rmtree(served.path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
