"""LoRA RL on the learner: peft's adapters injected into the HF model before Ulysses and FSDP2 wrap it, so the
rest of the learner (logprobs, checkpoints, the parallel layouts) sees the same module tree with a few more
parameters. Only the adapters require grad, so only they get gradients and optimizer state, and only they are
published: each version goes out as a PEFT adapter (names as PEFT's adapter_model.safetensors spells them), which
the generators' engines load as an adapter of its own (generator/engines/lora_adapter.py).

Why peft's `inject_adapter_in_model` and not `get_peft_model`: it mutates the HF model in place and returns it,
with no PeftModel wrapper, so the model's class, its `.model`/`.lm_head` and its layer list stay what FSDP2, the
Ulysses patch and the chunked logprob head expect."""
from asyncrl.weightsync.lora_names import ADAPTER_NAME, is_adapter_key


def peft_lora_config(lora):
    """peft's LoraConfig for learner.lora (LoraSettings)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none")


def apply_lora(model, lora):
    """Inject learner.lora's adapters into `model` in place: A random, B zero (so the first version is the base
    model), every other parameter frozen. A target list that matches no layer of this model raises ValueError."""
    from peft import inject_adapter_in_model

    try:
        model = inject_adapter_in_model(peft_lora_config(lora), model, adapter_name=ADAPTER_NAME)
    except ValueError as err:
        raise ValueError(f"learner.lora.target_modules={list(lora.target_modules)} do not fit "
                         f"{type(model).__name__}: {err}") from None
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    return model


def adapter_message(lora) -> dict:
    """What a generator needs besides the tensors to serve a version as an adapter: the `lora` entry of its
    announcement, and the adapter_config.json it writes from it."""
    return {"r": int(lora.rank), "lora_alpha": float(lora.alpha), "target_modules": list(lora.target_modules)}


def trainable_parameters(model) -> list:
    """The parameters the optimizer holds: all of them without LoRA, the adapters alone with it (a frozen
    parameter in AdamW would get no state, but listing only these says so and keeps the state dict small)."""
    return [param for param in model.parameters() if param.requires_grad]


def lora_meta(model) -> dict | None:
    """The adapter settings of an injected model (None without LoRA): what a checkpoint records, so a resume can
    refuse a different adapter and `asyncrl export` can rebuild it without the recipe."""
    config = (getattr(model, "peft_config", None) or {}).get(ADAPTER_NAME)
    if config is None:
        return None
    return {"r": int(config.r), "lora_alpha": float(config.lora_alpha), "lora_dropout": float(config.lora_dropout),
            "target_modules": sorted(config.target_modules)}
