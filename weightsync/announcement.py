"""The weights control message: what the learner announces for each published version, and where its bytes are.

One `WeightsAnnouncement` per version, built by the publisher alone (publisher.py) and read by attribute on both
sides: a field one side forgot is a TypeError where the message is built, not a `None` or a KeyError in the
generator's rollout loop. It travels as a plain dict of plain types (`to_wire`): in the buffer's replies (msgpack
over zmq, JSON in Redis; buffer/interface.py `Status.weights`) and in the catch-up server's replies (catchup.py).

A generator reads it off the network, so `from_wire` treats it as untrusted input: a malformed message raises
`AnnouncementError` naming the field, before anything is allocated. What needs torch (dtype sizes, offsets that fit
their buckets, the layout's fingerprint) is checked by layout.py's `layout_of` when the version is staged.

This module imports no torch, so the buffer (which carries the message and may not import torch) can decode it.
"""
from __future__ import annotations

from dataclasses import dataclass


class AnnouncementError(ValueError):
    """A weights announcement that is not well formed (the message names the field)."""


@dataclass(frozen=True)
class ShmRingPlace:
    """The learner's shared-memory ring (shm_ring.py): a generator on `host` maps `path` and copies a version out."""

    path: str
    host: str
    slots: int


@dataclass(frozen=True)
class BroadcastPlace:
    """The broadcast group's store (broadcast/sender.py): a generator joins it to receive versions as they go."""

    address: str
    """host:port of the learner's TCPStore."""
    backend: str
    """gloo or nccl."""


@dataclass(frozen=True)
class WeightsAnnouncement:
    """One published version: its bucket layout, one checksum per bucket, and the data planes that hold it.

    The layout is kept as the parallel lists it travels as (one entry per tensor, in publishing order); layout.py's
    `layout_of` turns them into a checked `Layout`."""

    version: int
    publisher: str
    """The learner life that published it: a learner resumed from a checkpoint publishes version numbers an earlier
    life already used, with other bytes, and a generator tells the two apart by this."""
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    buckets: tuple[int, ...]
    """The bucket each tensor sits in."""
    offsets: tuple[int, ...]
    """Its byte offset in that bucket."""
    bucket_sizes: tuple[int, ...]
    checksums: tuple[str, ...]
    """xxh3-64 of each bucket's bytes (layout.bucket_checksum)."""
    fingerprint: str
    """Same value <=> same layout: a receiver's preallocated buffers still fit (layout.Layout.fingerprint)."""
    nbytes: int
    """The version's bytes (the sum of bucket_sizes)."""
    published_at: float
    """time.time() on the learner when the version was complete."""
    shm: ShmRingPlace | None = None
    catchup: str = ""
    """The catch-up server's tcp:// address; "" when the learner runs none."""
    broadcast: BroadcastPlace | None = None
    """With weightsync.backend=broadcast."""
    engines: str = ""
    """With weightsync.backend=engine_push: the learner's TCPStore, where a generator registers its engine."""
    lora: dict | None = None
    """A LoRA version: the adapter's settings (r, lora_alpha, target_modules), checked by the engine that loads it
    (generator/engines/lora_adapter.py); None for a full version."""

    def to_wire(self) -> dict:
        """A plain dict of plain types (msgpack and JSON carry it as is)."""
        return {"version": self.version, "publisher": self.publisher, "names": list(self.names),
                "dtypes": list(self.dtypes), "shapes": [list(shape) for shape in self.shapes],
                "buckets": list(self.buckets), "offsets": list(self.offsets), "bucket_sizes": list(self.bucket_sizes),
                "checksums": list(self.checksums), "fingerprint": self.fingerprint, "nbytes": self.nbytes,
                "published_at": self.published_at,
                "shm": None if self.shm is None else {"path": self.shm.path, "host": self.shm.host,
                                                      "slots": self.shm.slots},
                "catchup": self.catchup,
                "broadcast": None if self.broadcast is None else {"address": self.broadcast.address,
                                                                  "backend": self.broadcast.backend},
                "engines": self.engines, "lora": self.lora}

    @classmethod
    def from_wire(cls, wire) -> WeightsAnnouncement:
        """The announcement `wire` (as `to_wire` made it, after msgpack or JSON), or AnnouncementError naming the
        first field that is missing or of the wrong type."""
        if not isinstance(wire, dict):
            raise AnnouncementError(f"weights control message is a {type(wire).__name__}, not a mapping")
        read = _Reader(wire)
        version = read.integer("version")
        names = read.items("names", str)
        length = len(names)
        announcement = cls(
            version=version, publisher=read.text("publisher"), names=names,
            dtypes=read.items("dtypes", str, length), shapes=read.shapes(length),
            buckets=read.items("buckets", int, length), offsets=read.items("offsets", int, length),
            bucket_sizes=read.items("bucket_sizes", int), checksums=read.items("checksums", str),
            fingerprint=read.text("fingerprint"), nbytes=read.integer("nbytes"),
            published_at=read.number("published_at"), shm=read.shm(), catchup=read.text("catchup", ""),
            broadcast=read.broadcast(), engines=read.text("engines", ""), lora=read.mapping("lora"))
        if len(announcement.checksums) != len(announcement.bucket_sizes):
            raise AnnouncementError(f"weights v{version}: {len(announcement.bucket_sizes)} buckets but "
                                    f"{len(announcement.checksums)} checksums")
        if announcement.nbytes != sum(announcement.bucket_sizes):
            raise AnnouncementError(f"weights v{version}: nbytes {announcement.nbytes} is not the sum of its "
                                    f"bucket sizes")
        return announcement


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Reader:
    """Typed reads of one wire dict; each error names the field and the version (when it is known)."""

    def __init__(self, wire: dict):
        self.wire = wire
        version = wire.get("version")
        self.where = f"weights v{version}" if _is_int(version) else "weights control message"

    def fail(self, key: str, wanted: str):
        value = self.wire[key] if key in self.wire else None
        what = "is missing" if key not in self.wire else f"is {type(value).__name__} {value!r:.60}"
        raise AnnouncementError(f"{self.where}: field {key!r} {what}, expected {wanted}")

    def integer(self, key: str) -> int:
        value = self.wire.get(key)
        if not _is_int(value) or value < 0:
            self.fail(key, "an integer >= 0")
        return value

    def number(self, key: str) -> float:
        value = self.wire.get(key)
        if not (_is_int(value) or isinstance(value, float)):
            self.fail(key, "a number")
        return float(value)

    def text(self, key: str, default: str | None = None) -> str:
        value = self.wire.get(key, default)
        if not isinstance(value, str):
            self.fail(key, "a string")
        return value

    def mapping(self, key: str) -> dict | None:
        value = self.wire.get(key)
        if value is not None and not isinstance(value, dict):
            self.fail(key, "a mapping or null")
        return value

    def items(self, key: str, kind: type, length: int | None = None) -> tuple:
        value = self.wire.get(key)
        ok = isinstance(value, (list, tuple)) and all(
            _is_int(item) and item >= 0 if kind is int else isinstance(item, kind) for item in value)
        if not ok:
            self.fail(key, f"a list of {'integers >= 0' if kind is int else kind.__name__ + 's'}")
        if length is not None and len(value) != length:
            raise AnnouncementError(f"{self.where}: {len(value)} {key} for {length} names")
        return tuple(value)

    def shapes(self, length: int) -> tuple:
        value = self.wire.get("shapes")
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(shape, (list, tuple)) and all(_is_int(dim) and dim >= 0 for dim in shape)
                for shape in value):
            self.fail("shapes", "a list of shapes (lists of integers >= 0)")
        if len(value) != length:
            raise AnnouncementError(f"{self.where}: {len(value)} shapes for {length} names")
        return tuple(tuple(shape) for shape in value)

    def shm(self) -> ShmRingPlace | None:
        value = self.mapping("shm")
        if value is None:
            return None
        path, host, slots = value.get("path"), value.get("host"), value.get("slots")
        if not (isinstance(path, str) and isinstance(host, str) and _is_int(slots) and slots > 0):
            self.fail("shm", "{path: str, host: str, slots: int > 0}")
        return ShmRingPlace(path, host, slots)

    def broadcast(self) -> BroadcastPlace | None:
        value = self.mapping("broadcast")
        if value is None:
            return None
        address, backend = value.get("address"), value.get("backend")
        if not (isinstance(address, str) and isinstance(backend, str)):
            self.fail("broadcast", "{address: str, backend: str}")
        return BroadcastPlace(address, backend)
