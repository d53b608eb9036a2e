"""Dtypes by name: the one table. Configs, weights announcements and checkpoints name dtypes as strings ("bfloat16"),
and every part that turns a name into a torch dtype (the learner's model and FSDP2 mixed precision, export, weight
sync, the engines) reads this table, so a name one part accepts is never unknown to another."""
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
"""Every dtype weight sync carries (parameters and buffers of HF models)."""
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
"""What models, engines and mixed precision compute in (the configs' dtype options)."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
