"""`asyncrl export`: a DCP checkpoint (any world size) -> an HF directory (safetensors, config, tokenizer).

Runs in one process with no process group. Only the model part of the checkpoint is read, into fresh tensors of the
saved shapes and dtypes, so the optimizer state never occupies memory. DCP resharding does the gather: the saved
tensors are global (FSDP2 DTensors are recorded by their global shape), whatever world size wrote them.
"""
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp

from asyncrl.learner.checkpoint import (DCP_DIR, HF_DIR, CheckpointError, quiet_single_process_dcp, read_meta,
                                        resolve_checkpoint)
from asyncrl.weightsync.dtypes import DTYPES, FLOAT_DTYPES

MODEL_KEY = "model"  # save_checkpoint's top-level key for get_state_dict's model part


def export_checkpoint(checkpoint: str, out_dir: str, dtype: str | None = None, adapter_dir: str | None = None) -> str:
    """Writes HF safetensors (model.save_pretrained), the config and the tokenizer from checkpoint/hf/ into out_dir,
    from a checkpoint written by save_checkpoint (single process, no PG needed, whatever world size saved it). The
    model is built with its auto class's from_config(config) (data/vision.py) and loaded from the DCP model state; tied
    embeddings come out right. dtype None keeps the config's torch dtype / fp32. Returns out_dir. A `checkpoint`
    that is a root of several step-* dirs means its latest one.

    A LoRA checkpoint (learner.lora) is rebuilt as peft's PeftModel from the settings its meta.json recorded, and
    written merged (peft's merge_and_unload: W + alpha/r · B @ A), so anything that serves HF models serves it;
    `adapter_dir` also writes the PEFT adapter directory (PeftModel.save_pretrained) for engines that load the
    adapter beside the base model. `adapter_dir` on a checkpoint without LoRA is an error."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"export dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    path = resolve_checkpoint(checkpoint)
    hf_dir = os.path.join(path, HF_DIR)
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise CheckpointError(f"checkpoint {path} has no {HF_DIR}/config.json: save it with model_dir= to export it")
    from transformers import AutoConfig

    from asyncrl.data.vision import auto_model_class

    config = AutoConfig.from_pretrained(hf_dir)
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    lora = read_meta(path).get("lora")
    if adapter_dir is not None and not lora:
        raise CheckpointError(f"checkpoint {path} trained every weight (no learner.lora): it has no adapter to write")
    if lora:
        model = export_lora(model, lora, os.path.join(path, DCP_DIR), adapter_dir)
    else:
        load_model_weights(model, os.path.join(path, DCP_DIR))
    model.to(DTYPES[dtype] if dtype is not None else config_dtype(config))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in os.listdir(hf_dir):  # tokenizer and generation config exactly as the base model had them
        if name != "config.json":
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    return out_dir


def export_lora(model, lora: dict, dcp_dir: str, adapter_dir: str | None):
    """The merged plain model of a LoRA checkpoint (and its adapter directory when `adapter_dir`)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"],
                                                  lora_dropout=lora["lora_dropout"],
                                                  target_modules=list(lora["target_modules"]), bias="none"))
    load_model_weights(peft_model.get_base_model(), dcp_dir)  # the learner's module tree: the same keys
    if adapter_dir is not None:
        peft_model.save_pretrained(adapter_dir)
    return peft_model.merge_and_unload()


def load_model_weights(model, dcp_dir: str) -> None:
    """Loads the checkpoint's model tensors into `model` (plain, not sharded). Keys are the canonical FQNs that
    `get_model_state_dict` wrote; a tied weight is saved once, under its first FQN, and filled here by the tie."""
    try:
        metadata = dcp.FileSystemReader(dcp_dir).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unreadable metadata means the same thing to the user
        raise CheckpointError(f"checkpoint {os.path.dirname(dcp_dir)}: unreadable DCP metadata: {err}") from err
    prefix = MODEL_KEY + "."
    saved = {key[len(prefix):]: meta for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and hasattr(meta, "size")}
    if not saved:
        raise CheckpointError(f"checkpoint {os.path.dirname(dcp_dir)} holds no model tensors")
    current = model.state_dict()
    # Read straight into the model's own tensors where shape and dtype match (no second copy of the weights).
    tensors = {fqn: current[fqn] if fqn in current and current[fqn].shape == meta.size
               and current[fqn].dtype == meta.properties.dtype else torch.empty(meta.size, dtype=meta.properties.dtype)
               for fqn, meta in saved.items()}
    with quiet_single_process_dcp():
        dcp.load({MODEL_KEY: tensors}, checkpoint_id=dcp_dir, no_dist=True)
    try:
        result = model.load_state_dict(tensors, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise CheckpointError(f"checkpoint {os.path.dirname(dcp_dir)} does not match its hf/config.json: {err}") from err
    loaded_storage = {current[fqn].data_ptr() for fqn in tensors if fqn in current}
    untied_missing = [key for key in result.missing_keys if current[key].data_ptr() not in loaded_storage]
    if result.unexpected_keys or untied_missing:
        raise CheckpointError(f"checkpoint {os.path.dirname(dcp_dir)} does not match its hf/config.json: "
                              f"missing {untied_missing[:5]}, unexpected {result.unexpected_keys[:5]}")


def config_dtype(config) -> torch.dtype:
    """The dtype the config records (transformers 5 `dtype`, older `torch_dtype`), else fp32."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32
