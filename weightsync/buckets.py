"""Preallocated flat bucket buffers and typed views into them.

Both ends keep one set of buffers for a layout and reuse it every version: the publisher copies each gathered
tensor into its place (`copy_` into existing memory runs at memory bandwidth; a fresh allocation is bound by page
faults), and a receiver reads tensors as views of the bytes it received, without a copy.
"""
import torch

from asyncrl.weightsync.dtypes import DTYPES
from asyncrl.weightsync.layout import Entry, Layout


class FlatBuckets:
    """One uint8 tensor per bucket of `layout`, allocated once (or wrapping memory the caller owns, such as a slot
    of a shared-memory mapping)."""

    def __init__(self, layout: Layout, buffers: list | None = None, device: str = "cpu"):
        self.layout = layout
        if buffers is None:
            buffers = [torch.empty(size, dtype=torch.uint8, device=device) for size in layout.bucket_sizes]
        if [b.numel() for b in buffers] != list(layout.bucket_sizes):
            raise ValueError(f"bucket buffers of {[b.numel() for b in buffers]} bytes do not fit the layout's "
                             f"{list(layout.bucket_sizes)}")
        self.buffers = buffers
        self._by_name = {entry.name: entry for entry in layout.entries}

    def view(self, entry: Entry) -> torch.Tensor:
        raw = self.buffers[entry.bucket][entry.offset:entry.offset + entry.nbytes]
        return raw.view(DTYPES[entry.dtype]).view(entry.shape)

    def put(self, name: str, tensor: torch.Tensor) -> Entry:
        """Copy `tensor` into its place. Its shape must match the layout's; a floating tensor of another dtype is
        cast by the copy itself (fp32 master weights published as bf16 are read once and written once, with no
        intermediate tensor to allocate)."""
        entry = self._by_name[name]
        target = self.view(entry)
        castable = tensor.dtype.is_floating_point and target.dtype.is_floating_point
        if tensor.shape != target.shape or (tensor.dtype != target.dtype and not castable):
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the layout has {entry.shape} "
                             f"{entry.dtype}")
        target.copy_(tensor.detach())
        return entry

    def tensors(self, bucket: int | None = None):
        """(name, typed view) for every tensor, or those of one bucket, in layout order."""
        for entry in self.layout.entries:
            if bucket is None or entry.bucket == bucket:
                yield entry.name, self.view(entry)
