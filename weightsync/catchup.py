"""The catch-up path: a generator that joined late, restarted, missed a broadcast, or lives on another host without
the broadcast group asks the learner for a version and gets it whole, without involving anyone else.

The server is a ZeroMQ ROUTER on its own thread in the learner process. It answers from the ring (shm_ring.py)
with one multipart reply, [announcement (JSON), bucket 0, bucket 1, ...], sending the mapping's bytes without a copy;
the learner's step never waits for it. Because those bytes are read after the reply is queued, a version the
learner overwrites meanwhile arrives mixed: the receiver checks every bucket's checksum against the announcement
and simply asks again (for the newest version), so mixed bytes are never loaded.

A generator that holds an earlier version b (named by its number and `delta.base_digest`) gets only what changed
since (delta.py), when the ring still holds b and the delta costs less than `delta_max_fraction` of the full
version; otherwise the full version. The last delta is kept, since a fleet asks for the same pair.

Encoding costs most of a delta fetch (docs/benchmarks.md measures it), so the server prepares the next one before
anyone asks: once it has served a delta b -> v, a fleet holds v, and when v' is announced the
server encodes v -> v' in its idle moments. A prepared delta that nobody asks for stops the preparing until the
next delta request, so a job whose generators are all on the learner's host (or in the broadcast group) pays
nothing for it.
"""
import json
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import zmq

from asyncrl.security.curve import CurveGuard, secure_client, warn_if_open
from asyncrl.weightsync import delta
from asyncrl.weightsync.announcement import AnnouncementError, WeightsAnnouncement
from asyncrl.weightsync.buckets import FlatBuckets

log = logging.getLogger(__name__)


class CatchupError(RuntimeError):
    """The catch-up server did not answer in time, or has no such version (the message names the server)."""


class CatchupServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise: str = "", delta_max_fraction: float = 0.5,
                 keys=None, prepare_deltas: bool = True):
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.curve = CurveGuard(self._context, keys, "the weight catch-up server")  # keys: curve.ServerKeys or None
        self.curve.before_bind(self._socket)
        try:
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
            else:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as err:
            self.curve.close()
            self._socket.close()
            self._context.term()
            raise CatchupError(f"weight catch-up server cannot bind {host}:{port}: {err}") from None
        self.curve.after_bind(self._socket)
        warn_if_open(host, keys, "the weight catch-up server")
        self.address = f"tcp://{advertise or host}:{port}"
        self._ring = None
        self._messages: dict[int, WeightsAnnouncement] = {}
        self._newest = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0
        self.delta_max_fraction = delta_max_fraction  # 0: always the full version
        self.prepare_deltas = prepare_deltas  # False: encode only on request (bench/weightsync_delta.py compares)
        self.deltas_served = 0
        self.sent_bytes = 0  # what the replies carried beyond their control messages
        self.full_bytes = 0  # what full copies of the same versions would have carried
        self._delta_cache: tuple = ((), None)  # ((base stamp, target stamp), encode's output)
        self._follow: int | None = None  # the version the fleet holds: the target of the last delta served
        self._prepare: int | None = None  # a version announced since, whose delta from _follow is to be encoded
        self._prepared: tuple | None = None  # (base, target) encoded ahead and not asked for yet
        self.deltas_prepared = 0
        self.prepared_used = 0  # requests answered from a delta encoded before they came
        self._files: tuple = ("", b"")  # (digest, archive) of the model's non-weight files (model_files.py)
        self._thread = threading.Thread(target=self._serve, name="asyncrl-weight-catchup", daemon=True)
        self._thread.start()

    def attach(self, ring) -> None:
        with self._lock:
            self._ring, self._messages = ring, {}

    def serve_files(self, blob: bytes, digest: str) -> None:
        """Answer {"files": ...} requests with this archive: a generator with nothing shared starts from it."""
        self._files = (digest, blob)

    def announce(self, message: WeightsAnnouncement) -> None:
        """A complete version is in the ring; keep the announcements of the versions the ring still holds."""
        with self._lock:
            self._messages[message.version] = message
            self._newest = message.version
            for old in [v for v in self._messages if v <= self._newest - self._ring.slots]:
                del self._messages[old]
            if self._prepared is not None:  # encoded for nobody: the fleet does not follow through catch-up (now)
                self._follow = self._prepared = None
            self._prepare = self._newest if self._follow is not None else None

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):  # idle: a short wait, so a delta is prepared soon after its version is announced
                self._prepare_next()
                continue
            identity, *frames = self._socket.recv_multipart()
            try:
                self._answer(identity, frames)
            except Exception as err:  # a request that breaks one answer must not stop the server for everyone
                log.exception("weight catch-up: a request failed (%s); serving on", err)
                self._reply(identity, {"error": f"the server failed to answer: {type(err).__name__}: {err}"})

    def _reply(self, identity: bytes, message: dict, frames=()) -> None:
        self._socket.send_multipart([identity, json.dumps(message).encode(), *frames], copy=False)

    def _answer(self, identity: bytes, frames: list) -> None:
        try:
            request = json.loads(frames[-1])
            if request.get("files"):
                digest, blob = self._files
                self._reply(identity, {"files": digest, "bytes": len(blob)} if digest else
                            {"error": "this learner serves no model files"}, [blob] if digest else [])
                return
            wanted = int(request.get("version", -1))
            base = request.get("base")
            base = (int(base), str(request.get("base_digest", ""))) if base is not None else None
        except (ValueError, TypeError, AttributeError, IndexError):
            self._reply(identity, {"error": "malformed request"})
            return
        with self._lock:
            version = self._newest if wanted < 0 else wanted
            message = self._messages.get(version)
            ring = self._ring
            slot = ring.find(version) if (message and ring is not None) else None
            base_message = self._messages.get(base[0]) if base is not None else None
        if slot is None:
            self._reply(identity, {"error": f"v{version} is not held (newest is v{self._newest})",
                                   "newest": self._newest})
            return
        patch = None
        if base_message and self.delta_max_fraction > 0 and delta.base_digest(base_message) == base[1]:
            patch = self._delta(ring, base[0], version, slot)
        self.full_bytes += message.nbytes  # counted before the reply goes, so a reader that got it sees them
        self.served += 1
        if patch is not None:
            entries, patch_frames = patch
            self.deltas_served += 1
            with self._lock:
                if self._prepared == (base[0], version):
                    self.prepared_used += 1
                self._prepared = None
                if self.prepare_deltas and (self._follow is None or version > self._follow):
                    self._follow = version
            self.sent_bytes += delta.nbytes(patch_frames)
            self._reply(identity, {**message.to_wire(), "delta": {"base": base[0], "entries": entries}},
                        [memoryview(frame.numpy()) for frame in patch_frames])
        else:
            self.sent_bytes += message.nbytes
            self._reply(identity, message.to_wire(), [memoryview(b.numpy()) for b in ring.buckets(slot).buffers])

    def _prepare_next(self) -> None:
        """Encode the delta from the version the fleet holds to the newest one, into the cache, ahead of the
        fleet's requests (on the server's thread, between them)."""
        with self._lock:
            target, base, ring = self._prepare, self._follow, self._ring
            self._prepare = None
            slot = ring.find(target) if (target is not None and ring is not None and
                                         target in self._messages and base in self._messages) else None
        if slot is None or base >= target:
            return
        patch = self._delta(ring, base, target, slot)
        with self._lock:
            if patch is None:  # deltas do not pay now (or a slot was reused): the next delta served starts again
                self._follow = None
            elif self._newest == target:
                self._prepared = (base, target)
            self.deltas_prepared += 1  # last: a reader that sees the count sees the state

    def _delta(self, ring, base_version: int, version: int, slot: int):
        """encode's output for base_version -> version, or None (the base is gone from the ring, the delta is too
        large, or a slot was rewritten while it was read)."""
        base_slot = ring.find(base_version)
        if base_slot is None:
            return None
        stamps = (ring.stamp(base_slot), ring.stamp(slot))
        cached_stamps, cached = self._delta_cache
        if cached_stamps == stamps:
            return cached
        started = time.perf_counter()
        patch = delta.encode(ring.buckets(base_slot), ring.buckets(slot), self.delta_max_fraction)
        if (ring.stamp(base_slot), ring.stamp(slot)) != stamps:  # the learner reused a slot meanwhile
            return None
        self._delta_cache = (stamps, patch)
        log.debug("weight catch-up: delta v%d -> v%d in %.3f s (%s)", base_version, version,
                  time.perf_counter() - started,
                  "too large, full copy" if patch is None else f"{delta.nbytes(patch[1])} bytes")
        return patch

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.curve.close(self._socket)
        self._socket.close(linger=0)
        self._context.term()


def _ask(address: str, request: dict, timeout_s: float, keys, what: str) -> tuple[dict, list]:
    """Send one request to the catch-up server and return (its control message, the frames after it). `what` names
    the request in errors; a missing answer, a control message that is not a JSON object, or an error raise."""
    unanswered = CatchupError(f"weight catch-up server {address} did not answer {what} within {timeout_s:.0f} s"
                              + (" (with CURVE keys: does the learner use them, with this generator's public "
                                 "key?)" if keys else ""))
    deadline = time.monotonic() + timeout_s
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    # A refused CURVE handshake can take the socket's only pipe away before the send: a send without a timeout
    # then waits forever for a peer (seen under CI load), so the send shares the request's deadline.
    socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    secure_client(socket, keys)
    socket.connect(address)
    try:
        try:
            socket.send(json.dumps(request).encode())
        except zmq.Again:
            raise unanswered from None
        if not socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise unanswered
        frames = socket.recv_multipart(copy=False)
    finally:
        socket.close(linger=0)
    try:
        message = json.loads(frames[0].bytes)
    except ValueError:
        raise CatchupError(f"weight catch-up server {address} sent a control message that is not JSON") from None
    if not isinstance(message, dict):
        raise CatchupError(f"weight catch-up server {address} sent a control message that is not an object")
    if "error" in message:
        raise CatchupError(f"weight catch-up server {address}: {message['error']}")
    return message, frames[1:]


@dataclass
class Fetched:
    """What `fetch` got: the version's announcement, the buckets it was copied into, and whether the server sent
    only what changed since the caller's base (a delta whose checksums fail is fetched again whole)."""

    announcement: WeightsAnnouncement
    buckets: FlatBuckets
    delta: bool


def fetch(address: str, version: int, dest_for, timeout_s: float, base: FlatBuckets | None = None,
          base_message: WeightsAnnouncement | None = None, keys=None) -> Fetched:
    """Ask `address` for `version` (-1: the newest) and copy its buckets into `dest_for(announcement)` (FlatBuckets
    the caller owns, chosen once the announcement says which layout). With `base` (the caller's verified copy of the
    version `base_message` announced), the server may answer with a delta: the buckets are then `base` with the
    changes applied. Checksums are the caller's (a delta that does not reproduce them is caught there).
    `keys` (security.curve.ClientKeys): this generator's CURVE keys, when the server wants them."""
    request = {"version": version}
    if base is not None and base_message is not None:
        request.update(base=int(base_message.version), base_digest=delta.base_digest(base_message))
    wire, frames = _ask(address, request, timeout_s, keys, f"for v{version}")
    patch = wire.pop("delta", None)
    try:
        message = WeightsAnnouncement.from_wire(wire)
    except AnnouncementError as err:
        raise CatchupError(f"weight catch-up server {address}: {err}") from None
    dest = dest_for(message)
    if patch is not None:
        if base is None or not isinstance(patch, dict) or patch.get("base") != base_message.version:
            raise CatchupError(f"weight catch-up server {address} sent a delta from a base this generator did not "
                               f"name")
        if base.layout.fingerprint != dest.layout.fingerprint:
            raise CatchupError(f"weight catch-up server {address} sent a delta between two layouts")
        for source, target in zip(base.buffers, dest.buffers):
            if source.data_ptr() != target.data_ptr():
                target.copy_(source)
        try:
            delta.apply(dest, patch.get("entries"), [frame.buffer for frame in frames])
        except delta.DeltaError as err:
            raise CatchupError(f"weight catch-up server {address}: {err}") from None
        return Fetched(message, dest, delta=True)
    if len(frames) != len(dest.buffers):
        raise CatchupError(f"weight catch-up server {address} sent {len(frames)} buckets for v{message.version}"
                           f", the layout has {len(dest.buffers)}")
    for frame, target in zip(frames, dest.buffers):
        source = np.frombuffer(frame.buffer, dtype=np.uint8)  # read-only view of the received frame
        if source.size != target.numel():
            raise CatchupError(f"weight catch-up server {address}: a bucket of v{message.version} has "
                               f"{source.size} bytes, the layout says {target.numel()}")
        np.copyto(target.numpy(), source)
    return Fetched(message, dest, delta=False)


def fetch_files(address: str, timeout_s: float, keys=None) -> tuple[bytes, str]:
    """(archive, digest) of the learner's model files (model_files.py checks the digest when unpacking)."""
    message, frames = _ask(address, {"files": True}, timeout_s, keys, "for the model files")
    if len(frames) != 1:
        raise CatchupError(f"weight catch-up server {address} sent {len(frames)} frames for the model files, not 1")
    return frames[0].bytes, str(message.get("files", ""))
