"""A persistent shared-memory mapping with a few version slots, written in place and read without locks.

Why: recreating a file per version runs at about 1.3 GB/s here, while writing into an existing mapping runs at
memory bandwidth (docs/platform.md, weight-transfer bandwidth). The learner keeps one ring for the job
(`weightsync.keep_versions` slots) and writes version v into slot v % slots; receivers on its host map the same
file once. Each generator keeps a ring of its own as staging (three slots: the loaded version, the one being
loaded, and one free for the next arrival), which the vLLM worker process maps too, so a version reaches the
engine without another copy.

Every slot has a sequence counter (a seqlock): odd while it is being written, even once it holds a complete
version. A reader records the counter and version before copying and checks them again afterwards; a slot the
writer reused meanwhile is detected and the copy discarded, so a reader never hands on bytes mixed from two
versions. Checksums (layout.py) catch everything else.
"""
import mmap
import os

import numpy as np
import torch

from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.layout import Layout

MAGIC = 0x41535752494E4731  # "ASWRING1"
HEADER = 4096
PAGE = 4096
FINGERPRINT_AT = 32


class RingError(RuntimeError):
    """The mapping is missing, of another layout, or a slot changed while it was read."""


def slot_bytes(layout: Layout) -> int:
    return sum(-(-size // PAGE) * PAGE for size in layout.bucket_sizes)


class ShmRing:
    """`create=True` makes (or resizes) the file; otherwise an existing ring of the same layout is opened."""

    def __init__(self, path: str, layout: Layout, slots: int, create: bool):
        self.path, self.layout, self.slots = path, layout, slots
        self.slot_size = slot_bytes(layout)
        size = HEADER + slots * self.slot_size
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, size)
        else:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as err:
                raise RingError(f"weight ring {path} cannot be opened ({err.strerror}); it lives on the learner's "
                                f"host only") from None
            actual = os.fstat(fd).st_size
            if actual != size:
                os.close(fd)
                raise RingError(f"weight ring {path} is {actual} bytes, the control message's layout needs {size}: "
                                f"it holds another layout")
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._words = np.frombuffer(self._map, dtype=np.int64, count=HEADER // 8)
        fingerprint = np.frombuffer(layout.fingerprint.encode().ljust(16, b"\0"), dtype=np.int64)
        if create:
            self._words[:] = 0
            self._words[0], self._words[1] = MAGIC, slots
            self._words[FINGERPRINT_AT // 8:FINGERPRINT_AT // 8 + 2] = fingerprint
        elif self._words[0] != MAGIC or self._words[1] != slots or not np.array_equal(
                self._words[FINGERPRINT_AT // 8:FINGERPRINT_AT // 8 + 2], fingerprint):
            self.close()
            raise RingError(f"weight ring {path} holds another layout than the control message's")
        self._views = [FlatBuckets(layout, self._slot_buffers(slot)) for slot in range(slots)]

    def _slot_buffers(self, slot: int) -> list:
        buffers, at = [], HEADER + slot * self.slot_size
        for size in self.layout.bucket_sizes:
            buffers.append(self._bytes[at:at + size])
            at += -(-size // PAGE) * PAGE
        return buffers

    # slot i's counter and version sit at words 8 + 2i and 9 + 2i
    def stamp(self, slot: int) -> tuple[int, int]:
        """(sequence, version) of a slot: an odd sequence means a write is in progress."""
        return int(self._words[8 + 2 * slot]), int(self._words[9 + 2 * slot])

    def buckets(self, slot: int) -> FlatBuckets:
        return self._views[slot]

    def begin_write(self, slot: int) -> None:
        sequence = self._words[8 + 2 * slot]
        self._words[8 + 2 * slot] = sequence + 1 if sequence % 2 == 0 else sequence + 2

    def end_write(self, slot: int, version: int) -> None:
        self._words[9 + 2 * slot] = version
        self._words[8 + 2 * slot] += 1

    def find(self, version: int) -> int | None:
        """The slot holding a complete `version`, if any."""
        for slot in range(self.slots):
            sequence, held = self.stamp(slot)
            if sequence and sequence % 2 == 0 and held == version:
                return slot
        return None

    def copy_out(self, version: int, dest: FlatBuckets) -> None:
        """Copy a complete `version` into `dest`, or raise RingError if it is not here or was overwritten while
        being copied (the caller then fetches it another way)."""
        slot = self.find(version)
        if slot is None:
            raise RingError(f"weights v{version} are no longer in {self.path} (overwritten by newer versions)")
        before = self.stamp(slot)
        for source, target in zip(self._views[slot].buffers, dest.buffers):
            target.copy_(source)
        if self.stamp(slot) != before:
            raise RingError(f"weights v{version} in {self.path} were overwritten while being read")

    def close(self, unlink: bool = False) -> None:
        self._views, self._bytes, self._words = [], None, None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def remove_stale(directory: str, prefix: str, suffix: str = "") -> list[str]:
    """Delete `<prefix><pid><suffix>` files in `directory` whose process is gone. A learner or generator killed with
    -9 cannot remove its mapping (a ring holds keep_versions copies of the model), so the next one started on the
    host does. A pid reused by an unrelated process keeps its file: that errs on the side of keeping."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        pid = name[len(prefix):len(name) - len(suffix)]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
        except PermissionError:  # alive, another user's
            pass
    return removed
