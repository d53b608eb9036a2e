"""A small model's named tensors (one bf16) and publishing them, for the weight-sync tests."""
import torch


def model_tensors(seed: int, scale: float = 1.0) -> list:
    torch.manual_seed(seed)
    return [("embed.weight", torch.randn(50, 16) * scale), ("layer.0.w", torch.randn(16, 16)),
            ("layer.0.b", torch.randn(3)), ("norm.weight", torch.randn(16).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(50, 16))]


def publish(publisher, tensors, version):
    return publisher.publish(iter(tensors), version, specs_of(tensors))


def specs_of(tensors):
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors]
