"""How a LoRA version travels (weight sync's contract between a LoRA learner, learner/lora.py, and the engines,
generator/engines/lora_adapter.py): only the adapter's tensors, each named as PEFT's adapter_model.safetensors
names it, which is also the name vLLM's adapter loader reads; the announcement's `lora` entry carries the rank,
alpha and target modules."""

ADAPTER_PREFIX = "base_model.model."
"""PEFT's saved adapters name each tensor under the PeftModel's wrapper; vLLM's adapter loader expects it."""
ADAPTER_NAME = "default"
"""peft's name for the one adapter the learner trains; PEFT's files leave it out of the tensor names."""


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key of an injected model is one of the adapter's tensors."""
    return f".lora_A.{ADAPTER_NAME}." in name or f".lora_B.{ADAPTER_NAME}." in name


def adapter_file_name(key: str) -> str:
    """A state-dict key of the injected model -> the tensor's name in PEFT's adapter_model.safetensors
    (`model.layers.0.self_attn.q_proj.lora_A.default.weight` -> `base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight`)."""
    return ADAPTER_PREFIX + key.replace(f".{ADAPTER_NAME}.", ".")


def adapter_module_key(file_name: str) -> str:
    """The inverse of adapter_file_name."""
    if not file_name.startswith(ADAPTER_PREFIX):
        raise ValueError(f"adapter tensor {file_name!r} is not named as PEFT saves adapters ({ADAPTER_PREFIX}...)")
    stem = file_name[len(ADAPTER_PREFIX):]
    for part in (".lora_A.", ".lora_B."):
        if part in stem:
            return stem.replace(part, f"{part}{ADAPTER_NAME}.")
    raise ValueError(f"adapter tensor {file_name!r} is neither a lora_A nor a lora_B weight")
