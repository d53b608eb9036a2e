"""The learner's side of weight sync: one call per version, whatever the data planes.

`publish(named_tensors, version)` takes the full tensors as the FSDP gathers produce them (bucket by bucket, on
rank 0), copies each into its place in the ring slot for this version (the persistent shared-memory mapping,
shm_ring.py), and hands every completed bucket to a sender thread that checksums it and, when a broadcast group is
attached, sends it on while the main thread gathers the next bucket. It returns the announcement (announcement.py),
which the buffer announces to generators; a generator that missed the broadcast (it joined late, restarted, or
lives on another host without the group) fetches the same bytes from the catch-up server (catchup.py), which
serves them from the ring.

Nothing a receiver does can block `publish`: shared memory has no reader handshake, the broadcast group has
timeouts and drops dead members (its own module), and catch-up runs on its own thread.

A broadcast group on NCCL moves GPU memory only, so with one the publisher also keeps a set of buckets on the
group's device (`plane.device`, the learner's GPU): each gathered tensor is copied into its place there, device to
device, and the group sends those, never the CPU ring. The ring still gets its copy, for generators on this host
(shared memory) and on others (catch-up).
"""
import logging
import os
import queue
import threading
import time
import uuid
from typing import Protocol

import torch

from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.announcement import ShmRingPlace, WeightsAnnouncement
from asyncrl.weightsync.layout import Layout, announcement_for, bucket_checksum, plan_layout
from asyncrl.weightsync.shm_ring import ShmRing

log = logging.getLogger(__name__)


class DataPlane(Protocol):
    """A data plane beside the ring that sends each version on as it is published (backends.BroadcastPlane, the
    chain relay; backends.EnginePushPlane, the push into engines). Its `send` never raises for a generator's
    failure: a generator that missed a version fetches it from the ring or the catch-up server."""

    device: torch.device
    """Where the buckets it sends must be (the publisher keeps a copy there when it is not the CPU)."""

    def describe(self) -> dict:
        """Where the announcement names this plane: WeightsAnnouncement fields (broadcast=..., engines=...)."""

    def send(self, version: int, buffers: list, ready=None, layout: Layout | None = None) -> None:
        """Send `version`'s buckets; `ready(k, deadline)` waits until bucket k is complete."""

    def close(self) -> None:
        """Release the plane's store and groups."""


class PublishError(RuntimeError):
    """A version could not be published (the message names the tensor or the peer)."""


class WeightPublisher:
    """`ring_path`: the persistent mapping (on tmpfs); `slots`: versions kept readable at once (>= 2);
    `plane`: an optional data plane (a `DataPlane`: backends.BroadcastPlane, the chain; backends.EnginePushPlane,
    the push into engines); `catchup`: an optional server told about each complete version."""

    def __init__(self, ring_path: str, slots: int, bucket_bytes: int, plane=None, catchup=None, host: str = ""):
        self.ring_path = ring_path
        self.slots = slots
        self.bucket_bytes = bucket_bytes
        self.plane = plane
        self.catchup = catchup
        self.host = host or os.uname().nodename
        self.ring: ShmRing | None = None
        self.layout: Layout | None = None
        self.device_buckets: FlatBuckets | None = None  # the plane's copy on its device (NCCL: the GPU)
        self.timings: dict = {}
        self.life = uuid.uuid4().hex[:12]
        """Names this publisher in every message: a learner resumed from a checkpoint publishes version numbers the
        previous life already used, with other bytes, and a generator must tell the two apart."""

    def _ring_for(self, layout: Layout) -> ShmRing:
        if self.ring is None or self.layout.fingerprint != layout.fingerprint:
            if self.ring is not None:
                self.ring.close(unlink=True)
            os.makedirs(os.path.dirname(self.ring_path) or ".", exist_ok=True)
            self.ring = ShmRing(self.ring_path, layout, self.slots, create=True)  # once per job, then reused
            self.layout = layout
            device = self.plane.device if self.plane is not None else None
            self.device_buckets = (FlatBuckets(layout, device=device)
                                   if device is not None and torch.device(device).type != "cpu" else None)
            if self.catchup is not None:
                self.catchup.attach(self.ring)
        return self.ring

    def publish(self, named_tensors, version: int, specs: list, extra: dict | None = None) -> WeightsAnnouncement:
        """specs: (name, dtype name, shape) of every tensor in the order `named_tensors` yields them (known before
        any gather, from the sharded state dict). `extra`: more fields of the announcement (a LoRA version's `lora`
        settings). Returns the announcement of `version`."""
        started = time.perf_counter()
        layout = plan_layout(specs, self.bucket_bytes)
        ring = self._ring_for(layout)
        slot = version % self.slots
        buckets = ring.buckets(slot)
        remaining = [len(layout.in_bucket(index)) for index in range(len(layout.bucket_sizes))]
        checksums = [None] * len(remaining)
        device_buckets = self.device_buckets
        sender = _BucketSender(self.plane, version, buckets.buffers, checksums,
                               send_buffers=device_buckets.buffers if device_buckets is not None else None,
                               layout=layout)
        ring.begin_write(slot)
        seen, complete = set(), False
        try:
            for name, tensor in named_tensors:
                try:
                    entry = buckets.put(name, tensor)
                    if device_buckets is not None:
                        device_buckets.put(name, tensor)
                except KeyError:
                    raise PublishError(f"weights v{version}: tensor {name!r} is not in the layout (specs and "
                                       f"tensors disagree)") from None
                except ValueError as err:  # a shape, or a dtype no copy can cast, that the specs did not announce
                    raise PublishError(f"weights v{version}: {err}") from None
                seen.add(name)
                remaining[entry.bucket] -= 1
                if remaining[entry.bucket] == 0:
                    sender.put(entry.bucket)
            missing = [entry.name for entry in layout.entries if entry.name not in seen]
            if missing:
                raise PublishError(f"weights v{version}: {len(missing)} tensors never arrived, e.g. {missing[:3]}")
            complete = True
        finally:
            sender.close(aborted=not complete)
        sender.raise_error()
        ring.end_write(slot, version)
        places = {"shm": ShmRingPlace(self.ring_path, self.host, self.slots)}
        if self.plane is not None:
            places.update(self.plane.describe())
        if self.catchup is not None:
            places["catchup"] = self.catchup.address
        message = announcement_for(layout, version, checksums, publisher=self.life, published_at=time.time(),
                                   **places, **(extra or {}))
        if self.catchup is not None:
            self.catchup.announce(message)
        self.timings = {"publish_s": time.perf_counter() - started, "send_wait_s": sender.wait_s}
        return message

    def close(self) -> None:
        if self.catchup is not None:
            self.catchup.close()
        if self.plane is not None:
            self.plane.close()
        if self.ring is not None:
            self.ring.close(unlink=True)
            self.ring = None


class _BucketSender:
    """Completed buckets go on while the next ones are gathered: a checksum thread hashes each one, and a group
    thread (with a broadcast group) sends each one down the chain as soon as it is complete. xxhash and
    torch.distributed release the GIL, so both overlap the main thread's gathers and copies."""

    def __init__(self, plane, version: int, buffers: list, checksums: list, send_buffers: list | None = None,
                 layout: Layout | None = None):
        self.plane, self.version, self.buffers, self.checksums = plane, version, buffers, checksums
        self.layout = layout
        self.send_buffers = send_buffers if send_buffers is not None else buffers  # the plane's (its device's)
        self.queue: queue.Queue = queue.Queue()
        self.copied = [threading.Event() for _ in buffers]
        self.aborted = False
        self.error: BaseException | None = None
        self.plane_error: BaseException | None = None
        self.wait_s = 0.0
        self.threads = [threading.Thread(target=self._checksums, name="asyncrl-weight-checksums", daemon=True)]
        if plane is not None:
            self.threads.append(threading.Thread(target=self._send, name="asyncrl-weight-sender", daemon=True))
        for thread in self.threads:
            thread.start()

    def put(self, index: int) -> None:
        self.copied[index].set()
        self.queue.put(index)

    def _ready(self, index: int, deadline: float) -> bool:
        """For the group's send: wait until bucket `index` is copied (False if the publish was aborted)."""
        while not self.copied[index].wait(min(0.5, max(deadline - time.monotonic(), 0.0))):
            if self.aborted or time.monotonic() >= deadline:
                return False
        return not self.aborted

    def _checksums(self) -> None:
        while (index := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.checksums[index] = bucket_checksum(self.buffers[index])
                except BaseException as err:  # reported by raise_error once every bucket was consumed
                    self.error = err

    def _send(self) -> None:
        try:
            self.plane.send(self.version, self.send_buffers, ready=self._ready, layout=self.layout)
        except BaseException as err:  # the version is still in the ring and the catch-up server: logged only
            self.plane_error = err

    def close(self, aborted: bool = False) -> None:
        started = time.perf_counter()
        if aborted:
            self.aborted = True
        self.queue.put(None)
        for thread in self.threads:
            thread.join()
        self.wait_s = time.perf_counter() - started
        if self.plane_error is not None:
            log.warning("weight sync v%d: the broadcast failed (%s); generators fetch it from the catch-up server",
                        self.version, self.plane_error)

    def raise_error(self) -> None:
        if self.error is not None:
            raise PublishError(f"weights v{self.version}: {self.error}") from self.error
