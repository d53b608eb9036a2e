"""The learner's compute precision: bf16 autocast over fp32 master weights (`learner.autocast`), and attention that
stays in fp32 on CPU.

Why autocast: on a CPU with AVX512-BF16 (the development and CI machines), a bf16 matmul at the learner's shapes
runs 2.1-2.6x as fast as fp32, and matmuls are most of a step (63% of the demo's). Autocast runs the linear layers
in bf16 while the parameters, the optimizer's state, the residual stream, the norms and the softmaxes stay fp32, as
mixed precision does on a GPU; backward follows the forward's dtypes by itself.

Why fp32 attention on CPU: torch's CPU flash-attention kernel is slower in bf16 than in fp32 at these shapes (13 ms
against 1.1 ms for one of the demo's layers), enough to cancel everything the matmuls gain. Attention has no
weights, so running it in fp32 costs two casts of q, k and v. `CPU_SDPA` is HF's own sdpa function, registered
under its own name through transformers' public `AttentionInterface` (and its mask through
`AttentionMaskInterface`, so masks are built exactly as for "sdpa"), with autocast off inside and its inputs
upcast. On CUDA, where bf16 attention is the usual fast path, nothing here changes attention.
"""
import contextlib
import functools

import torch

from asyncrl.weightsync.dtypes import DTYPES

CPU_SDPA = "asyncrl_sdpa_fp32"
"""The registered name of sdpa with fp32 inputs and autocast off (CPU)."""
LOW_PRECISION = (torch.bfloat16, torch.float16)


def resolve_autocast(autocast: str, device) -> str:
    """learner.autocast with "auto" decided for `device`: bfloat16 where bf16 is computed natively (a CUDA device
    that supports it, a CPU with AVX512-BF16 or AMX-BF16), else "" (off): a CPU without them emulates bf16
    matmuls, which can cost more than fp32 (not measured here: both machines have AVX512-BF16)."""
    if autocast != "auto":
        return autocast
    kind = torch.device(device).type
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else ""
    return "bfloat16" if kind == "cpu" and cpu_has_native_bf16() else ""


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions, from the kernel's flags (Linux; elsewhere False, so "auto"
    stays fp32)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def autocast_context(device_type: str, autocast: str):
    """torch.autocast to `autocast`'s dtype on `device_type`, or a context that does nothing when it is ""."""
    if not autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[autocast])


def wants_fp32_attention(device: str, param_dtype: str, autocast: str) -> bool:
    """Whether attention should be upcast: on CPU, when its inputs can be low precision (autocast, resolved for the
    device, or bf16/fp16 parameters)."""
    return str(device).startswith("cpu") and (bool(resolve_autocast(autocast, device))
                                              or DTYPES[param_dtype] in LOW_PRECISION)


def in_fp32(attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
    """`attention(query, key, value, ...)` run on fp32 inputs with autocast off; its first output goes back to the
    query's dtype (the rest, HF's attention weights or None, as they come)."""
    dtype = query.dtype
    if dtype not in LOW_PRECISION and not torch.is_autocast_enabled(query.device.type):
        return attention(query, key, value, *args, **kwargs)
    with torch.autocast(query.device.type, enabled=False):
        out = attention(query.float(), key.float(), value.float(), *args, **kwargs)
    if isinstance(out, tuple):
        return (out[0].to(dtype), *out[1:])
    return out.to(dtype)


def sdpa_fp32(module, query, key, value, attention_mask, **kwargs):
    """HF's sdpa attention function (same signature and return) in fp32: see the module docstring."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return in_fp32(lambda q, k, v: sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs),
                   query, key, value)


def register_cpu_sdpa() -> str:
    """Register CPU_SDPA (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_SDPA, sdpa_fp32)
    AttentionMaskInterface.register(CPU_SDPA, sdpa_mask)
    return CPU_SDPA


def use_fp32_attention(model) -> bool:
    """Switch a model that runs HF's sdpa to CPU_SDPA; returns whether it switched (eager and flash-attention
    models, and Ulysses' own function, keep theirs: Ulysses upcasts its inner attention itself)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(register_cpu_sdpa())
    return True
