"""The generator's side of weight sync, up to the engine: bring an announced version into local staging, whole and
verified, before any engine touches it.

A generator keeps a staging ring of three slots (shm_ring.py): the version its engine runs (kept, so a failed load
can go back to it), the version being loaded, and one free slot where the next version lands. A version gets there
by the cheapest path that has it, each checked against the announcement's per-bucket checksums:
1. the broadcast group's background receiver already holds it (weightsync/broadcast/member.py): copy it in;
2. the learner's ring is on this host: copy it from the shared mapping (seqlock-checked);
3. otherwise ask the learner's catch-up server for it (catchup.py).
Only a `Staged` version — complete, checksummed, in a slot nobody writes to — is handed to an engine's receiver,
which loads it all or goes back to its last good version (generator/engines/*).
"""
import logging
import os
import threading
from dataclasses import dataclass

import torch

from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.announcement import BroadcastPlace, WeightsAnnouncement
from asyncrl.weightsync.catchup import CatchupError, fetch
from asyncrl.weightsync.layout import Layout, LayoutError, bucket_checksum, layout_of
from asyncrl.weightsync.shm_ring import RingError, ShmRing, remove_stale

log = logging.getLogger(__name__)
STAGING_SLOTS = 3


class WeightSyncError(RuntimeError):
    """No path could deliver a complete, verified copy of a version (the message says what each path did)."""


@dataclass
class Staged:
    """A complete, verified version in a staging slot; `ring_path` and `slot` let another process map it."""
    version: int
    announcement: WeightsAnnouncement
    ring_path: str
    slot: int
    buckets: FlatBuckets


def verify(buckets: FlatBuckets, message: WeightsAnnouncement) -> list[int]:
    """Indexes of the buckets whose bytes do not match the announcement's checksums."""
    return [index for index, (buffer, expected) in enumerate(zip(buckets.buffers, message.checksums))
            if bucket_checksum(buffer) != expected]


class WeightStage:
    def __init__(self, directory: str, name: str, catchup_timeout_s: float = 60.0, keys=None):
        self.name = name
        remove_stale(directory, f"asyncrl-stage-{name}-")  # a previous life of this generator, killed with -9
        self.path = os.path.join(directory, f"asyncrl-stage-{name}-{os.getpid()}")
        self.catchup_timeout_s = catchup_timeout_s
        self.keys = keys  # security.curve.ClientKeys for a catch-up server that wants CURVE, or None
        self.ring: ShmRing | None = None
        self.layout: Layout | None = None
        self.good: Staged | None = None  # what the engine runs
        self.loading: int | None = None  # the slot being staged or loaded
        self._lock = threading.Lock()
        self._learner_rings: dict[str, ShmRing] = {}
        self.paths_used = {"broadcast": 0, "shm": 0, "catchup": 0, "catchup_delta": 0}
        self.member = None  # broadcast.member.BroadcastMember, joined when an announcement names a group
        self._member_address = None
        self._received: tuple | None = None  # (version, buckets) taken from the member, not yet used
        self._last_delta = False  # the last catch-up answer was a delta (its checksums are checked in `stage`)

    def _ring_for(self, layout: Layout) -> ShmRing:
        if self.ring is None or self.layout.fingerprint != layout.fingerprint:
            if self.ring is not None:
                self.ring.close(unlink=True)
            self.ring = ShmRing(self.path, layout, STAGING_SLOTS, create=True)
            self.layout, self.good = layout, None  # the old slots hold another layout
        return self.ring

    def _reserve_loading(self, layout: Layout) -> int:
        """Pin a slot that neither the engine's version nor the one being loaded uses (the broadcast group's
        background receiver writes into buffers of its own, copied in by `_from_group`)."""
        with self._lock:
            self._ring_for(layout)
            pinned = {self.good.slot if self.good else None, self.loading}
            free = sorted(set(range(STAGING_SLOTS)) - pinned)
            if not free or self.loading is not None:
                raise WeightSyncError(f"no free staging slot (good={self.good and self.good.slot}, "
                                      f"loading={self.loading})")
            self.loading = free[0]
            return free[0]

    def stage(self, message: WeightsAnnouncement) -> Staged:
        """The announced version, complete and verified in a staging slot pinned until `end_load`, or
        WeightSyncError naming what each path did."""
        try:
            layout = layout_of(message)
        except LayoutError as err:
            raise WeightSyncError(str(err)) from None
        version = message.version
        with self._lock:
            ring = self._ring_for(layout)
            found = ring.find(version)
            if found is not None and found != self.loading:
                self.loading = found
        if self.loading == found and found is not None:
            if not verify(ring.buckets(found), message):  # staged before (a load of it failed, and is retried)
                return Staged(version, message, self.path, found, ring.buckets(found))
            self.end_load(None, ok=False)
        slot = self._reserve_loading(layout)
        tried = []
        self._last_delta = False
        for path, copy in (("broadcast", self._from_group), ("shm", self._from_learner_ring),
                           ("catchup", self._from_catchup), ("catchup", self._from_catchup_whole)):
            ring.begin_write(slot)
            try:
                if not copy(message, layout, ring.buckets(slot)):
                    continue
            except (RingError, CatchupError, OSError, RuntimeError) as err:
                tried.append(f"{path}: {err}")
                continue
            finally:
                ring.end_write(slot, -1)  # complete only once verified, below
            bad = verify(ring.buckets(slot), message)
            if bad:
                tried.append(f"{path}: buckets {bad[:5]} fail their checksums")
                continue
            ring.begin_write(slot)
            ring.end_write(slot, version)
            self.paths_used[path] += 1
            if self._last_delta:
                self.paths_used["catchup_delta"] += 1
            return Staged(version, message, self.path, slot, ring.buckets(slot))
        self.end_load(None, ok=False)
        raise WeightSyncError(f"weights v{version}: no complete copy could be staged ({'; '.join(tried) or 'no path'})")

    def _from_group(self, message: WeightsAnnouncement, layout: Layout, dest: FlatBuckets) -> bool:
        """What the broadcast group's background receiver delivered, if it is this version. The first announcement
        naming a group joins it (later versions then arrive without asking)."""
        group = message.broadcast
        if group is None:
            return False
        if self.member is None or self._member_address != group.address:
            self._join(group, layout)
            return False  # joining takes effect at the learner's next send
        while (latest := self.member.take_latest()) is not None:
            if self._received is not None:
                self.member.release(self._received[1])
            self._received = latest
        if self._received is None or self._received[0] != message.version:
            return False
        version, buckets = self._received
        self._received = None
        try:
            for source, target in zip(buckets, dest.buffers):
                target.copy_(source)
        finally:
            self.member.release(buckets)
        return True

    def _join(self, group: BroadcastPlace, layout: Layout) -> None:
        from asyncrl.weightsync.broadcast.chain import BACKENDS, bucket_device
        from asyncrl.weightsync.broadcast.member import BroadcastMember

        backend = group.backend
        if backend not in BACKENDS:
            raise WeightSyncError(f"the announcement names a broadcast group on backend {backend!r}; this "
                                  f"generator knows {BACKENDS}")
        if self.member is not None:
            self.member.close()
        sizes = list(layout.bucket_sizes)
        device = bucket_device(backend)  # NCCL receives into GPU memory; _from_group copies it into staging
        self.member = BroadcastMember.connect(group.address, self.name, self.catchup_timeout_s,
                                                backend=backend)
        self.member.start_receiving(lambda: [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes])
        self._member_address = group.address
        log.info("weight sync: %s joined the broadcast group at %s", self.name, group.address)

    def _from_learner_ring(self, message: WeightsAnnouncement, layout: Layout, dest: FlatBuckets) -> bool:
        shm = message.shm
        if shm is None or not shm.path or not os.path.exists(shm.path):
            return False  # another host: the catch-up path serves it
        inode = os.stat(shm.path).st_ino  # a ring re-created under the same name is another file
        cached = self._learner_rings.get(shm.path)
        if cached is None or cached[0] != inode or cached[1].layout.fingerprint != layout.fingerprint:
            if cached is not None:
                cached[1].close()
            cached = (inode, ShmRing(shm.path, layout, shm.slots, create=False))  # mapped once
            self._learner_rings[shm.path] = cached
        cached[1].copy_out(message.version, dest)
        return True

    def _from_catchup(self, message: WeightsAnnouncement, layout: Layout, dest: FlatBuckets) -> bool:
        if not message.catchup:
            return False
        base = self.good if self.good is not None and self.good.announcement.fingerprint == layout.fingerprint \
            else None  # the version the engine runs, verified: the server may send only what changed since
        got = fetch(message.catchup, message.version, lambda m: dest, self.catchup_timeout_s,
                    base=base.buckets if base else None, base_message=base.announcement if base else None,
                    keys=self.keys)
        if got.announcement.fingerprint != layout.fingerprint:
            raise CatchupError(f"{message.catchup} answered with another layout")
        self._last_delta = got.delta
        return True

    def _from_catchup_whole(self, message: WeightsAnnouncement, layout: Layout, dest: FlatBuckets) -> bool:
        """Only after a delta that failed the checksums (the server's base was not ours after all): the full
        version, one more request away."""
        if not self._last_delta:
            return False
        self._last_delta = False
        log.warning("weight sync: a delta to v%d from %s failed its checksums; fetching the full version",
                    message.version, message.catchup)
        fetch(message.catchup, message.version, lambda m: dest, self.catchup_timeout_s, keys=self.keys)
        return True

    def end_load(self, staged: Staged | None, ok: bool) -> None:
        """After the engine's load (`stage` pinned the slot): on success the staged version becomes the one to fall
        back to; either way the slot it replaced is free again."""
        with self._lock:
            self.loading = None
            if ok:
                self.good = staged

    def close(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None
        for _, ring in self._learner_rings.values():
            ring.close()
        if self.ring is not None:
            self.ring.close(unlink=True)
            self.ring = None
