"""The control plane of weight sync: one message per version says where every tensor sits in a few flat buckets.

Why flat buckets: the anchors' users' top complaint is weight sync bound by per-tensor control traffic (one RPC or
one collective per parameter). Here a version is `len(buckets)` contiguous byte buffers, each moved whole by any
data plane (shared memory, a broadcast group, the catch-up server), and one small message describes them all
(announcement.py's WeightsAnnouncement): version, names, dtypes, shapes, the bucket layout (bucket, byte offset per
tensor) and one checksum per bucket.

The layout depends only on the names, dtypes and shapes, so it is the same every version: both ends allocate their
bucket buffers once and reuse them (on CPU, fresh allocations cost more than the copy; docs/platform.md), and a
receiver can tell from `fingerprint` alone whether its buffers still fit.
"""
import hashlib
import json
from dataclasses import dataclass

import torch
import xxhash

from asyncrl.weightsync.announcement import AnnouncementError, WeightsAnnouncement
from asyncrl.weightsync.dtypes import DTYPES

ALIGN = 64  # every tensor starts on a cache line, so a typed view of the bucket is always aligned


class LayoutError(AnnouncementError):
    """An announcement that does not describe a loadable version (the message says what is wrong)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    entries: tuple
    bucket_sizes: tuple

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def fingerprint(self) -> str:
        """Same value <=> same names, dtypes, shapes and placement: preallocated buffers can be reused."""
        text = json.dumps([[e.name, e.dtype, list(e.shape), e.bucket, e.offset] for e in self.entries])
        return hashlib.sha1(text.encode() + str(self.bucket_sizes).encode()).hexdigest()[:16]

    def in_bucket(self, index: int) -> list:
        return [entry for entry in self.entries if entry.bucket == index]


def tensor_bytes(name: str, dtype: str, shape, where: str) -> int:
    if dtype not in DTYPES:
        raise LayoutError(f"{where}tensor {name!r} has dtype {dtype!r}, which weight sync does not carry")
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel * DTYPES[dtype].itemsize


def plan_layout(specs: list, bucket_bytes: int) -> Layout:
    """specs: (name, dtype name, shape) in publishing order. Consecutive tensors fill a bucket up to bucket_bytes;
    a larger tensor gets a bucket of its own. Offsets are ALIGN-aligned."""
    if bucket_bytes < ALIGN:
        raise LayoutError(f"bucket size must be >= {ALIGN} bytes, got {bucket_bytes}")
    entries, sizes, used = [], [], 0
    for name, dtype, shape in specs:
        nbytes = tensor_bytes(name, dtype, shape, "")
        start = -(-used // ALIGN) * ALIGN
        if not sizes or (start + nbytes > bucket_bytes and used > 0):
            sizes.append(0)
            start = 0
        entries.append(Entry(name, dtype, tuple(int(d) for d in shape), len(sizes) - 1, start, nbytes))
        used = start + nbytes
        sizes[-1] = used
    return Layout(tuple(entries), tuple(sizes))


def bucket_checksum(bucket: torch.Tensor) -> str:
    """xxh3-64 of a bucket's bytes (about 10x faster than CRC32 here, so checking every version is cheap)."""
    return xxhash.xxh3_64_hexdigest(memoryview(bucket.numpy()))


def announcement_for(layout: Layout, version: int, checksums: list, *, publisher: str, published_at: float,
                     **places) -> WeightsAnnouncement:
    """The announcement of `version` laid out as `layout`. `places`: where the bytes are, as WeightsAnnouncement
    names them (shm, catchup, broadcast, engines), and a LoRA version's `lora` settings."""
    return WeightsAnnouncement(
        version=int(version), publisher=publisher, names=tuple(e.name for e in layout.entries),
        dtypes=tuple(e.dtype for e in layout.entries), shapes=tuple(e.shape for e in layout.entries),
        buckets=tuple(e.bucket for e in layout.entries), offsets=tuple(e.offset for e in layout.entries),
        bucket_sizes=tuple(layout.bucket_sizes), checksums=tuple(checksums), fingerprint=layout.fingerprint,
        nbytes=layout.total_bytes, published_at=float(published_at), **places)


def layout_of(announcement: WeightsAnnouncement) -> Layout:
    """The layout an announcement describes, checked before anything is allocated or loaded: every dtype is one
    weight sync carries, every tensor fits its bucket, and the fingerprint matches (announcement.py's `from_wire`
    has checked the types and lengths)."""
    where = f"weights v{announcement.version}: "
    sizes = announcement.bucket_sizes
    entries = []
    for name, dtype, shape, bucket, offset in zip(announcement.names, announcement.dtypes, announcement.shapes,
                                                  announcement.buckets, announcement.offsets):
        nbytes = tensor_bytes(name, dtype, shape, where)
        if not 0 <= bucket < len(sizes) or offset < 0 or offset + nbytes > sizes[bucket] or offset % ALIGN:
            raise LayoutError(f"{where}{name!r} at bucket {bucket} offset {offset} ({nbytes} bytes) does not fit the "
                              f"bucket sizes {list(sizes)}")
        entries.append(Entry(name, dtype, tuple(int(d) for d in shape), int(bucket), int(offset), nbytes))
    layout = Layout(tuple(entries), tuple(int(size) for size in sizes))
    if announcement.fingerprint != layout.fingerprint:
        raise LayoutError(f"{where}the layout's fingerprint does not match its fields")
    return layout
