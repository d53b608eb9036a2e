"""Shared-memory weight sync: the learner writes each version as safetensors in a tmpfs directory; receivers on
the same host verify the file against the control message, then load it.

Control message (one per version): version, path, names, dtypes, shapes, bytes and a CRC32 checksum of the file.
A version directory appears atomically (written under a temporary name, then renamed), and the last
`keep_versions` stay on disk so a receiver still reading one is never cut off.
"""
import os
import shutil
import time
import zlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS_FILE = "model.safetensors"


class WeightSyncError(RuntimeError):
    """A published version is missing, incomplete, or does not match its control message."""


class ShmWeightPublisher:
    def __init__(self, root: str, keep_versions: int, dtype: str):
        self.root = root
        self.keep_versions = keep_versions
        self.dtype = DTYPES[dtype]
        os.makedirs(root, exist_ok=True)

    def publish(self, named_tensors, version: int) -> dict:
        """Cast once to the engine dtype, write, rename into place, and return the control message."""
        from safetensors.torch import save_file

        tensors, seen = {}, set()
        for name, tensor in named_tensors:
            # Tied weights (lm_head = embed_tokens) are written under both names: vLLM's in-place CPU reload
            # re-creates the embedding, and without an lm_head entry the head would keep the old weights.
            tensor = tensor.detach().to(device="cpu", dtype=self.dtype)
            tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor.contiguous()
            seen.add(tensor.data_ptr())
        final = os.path.join(self.root, f"v{version:08d}")
        staging = final + f".tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        path = os.path.join(staging, WEIGHTS_FILE)
        save_file(tensors, path, metadata={"asyncrl_version": str(version)})
        checksum = file_crc32(path)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)
        self._prune(version)
        return {
            "version": version,
            "path": final,
            "names": list(tensors),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "bytes": os.path.getsize(os.path.join(final, WEIGHTS_FILE)),
            "checksum": checksum,
            "published_at": time.time(),
        }

    def _prune(self, newest: int) -> None:
        for entry in os.listdir(self.root):
            if entry.startswith("v") and entry[1:].isdigit() and int(entry[1:]) <= newest - self.keep_versions:
                shutil.rmtree(os.path.join(self.root, entry), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def file_crc32(path: str) -> int:
    checksum = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            checksum = zlib.crc32(chunk, checksum)
    return checksum


def verify_published(descriptor: dict) -> str:
    """Check a published version completely before any engine loads it; returns the safetensors file path."""
    path = os.path.join(descriptor.get("path", ""), WEIGHTS_FILE)
    version = descriptor.get("version")
    if not os.path.isfile(path):
        raise WeightSyncError(f"weights v{version}: {path} is missing (pruned, or not on this host)")
    size = os.path.getsize(path)
    if size != descriptor.get("bytes"):
        raise WeightSyncError(f"weights v{version}: {path} has {size} bytes, the control message says {descriptor.get('bytes')}")
    if file_crc32(path) != descriptor.get("checksum"):
        raise WeightSyncError(f"weights v{version}: checksum of {path} does not match the control message")
    return path
