"""The catch-up path: a generator that joined late, restarted, missed a broadcast, or lives on another host without
the broadcast group asks the learner for a version and gets it whole, without involving anyone else.

The server is a ZeroMQ ROUTER on its own thread in the learner process. It answers from the ring (shm_ring.py)
with one multipart reply, [control message, bucket 0, bucket 1, ...], sending the mapping's bytes without a copy;
the learner's step never waits for it. Because those bytes are read after the reply is queued, a version the
learner overwrites meanwhile arrives mixed: the receiver checks every bucket's checksum against the control message
and simply asks again (for the newest version), so mixed bytes are never loaded.
"""
import json
import logging
import threading

import numpy as np
import zmq

from asyncrl.weightsync.buckets import FlatBuckets

log = logging.getLogger(__name__)


class CatchupError(RuntimeError):
    """The catch-up server did not answer in time, or has no such version (the message names the server)."""


class CatchupServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise: str = ""):
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
            else:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as err:
            self._socket.close()
            self._context.term()
            raise CatchupError(f"weight catch-up server cannot bind {host}:{port}: {err}") from None
        self.address = f"tcp://{advertise or host}:{port}"
        self._ring = None
        self._messages: dict[int, dict] = {}
        self._newest = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0
        self._thread = threading.Thread(target=self._serve, name="asyncrl-weight-catchup", daemon=True)
        self._thread.start()

    def attach(self, ring) -> None:
        with self._lock:
            self._ring, self._messages = ring, {}

    def announce(self, message: dict) -> None:
        """A complete version is in the ring; keep the messages of the versions the ring still holds."""
        with self._lock:
            self._messages[message["version"]] = message
            self._newest = message["version"]
            for old in [v for v in self._messages if v <= self._newest - self._ring.slots]:
                del self._messages[old]

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            identity, *frames = self._socket.recv_multipart()
            try:
                wanted = int(json.loads(frames[-1]).get("version", -1))
            except (ValueError, TypeError, AttributeError):
                self._socket.send_multipart([identity, json.dumps({"error": "malformed request"}).encode()])
                continue
            with self._lock:
                version = self._newest if wanted < 0 else wanted
                message = self._messages.get(version)
                slot = self._ring.find(version) if (message and self._ring is not None) else None
                buffers = self._ring.buckets(slot).buffers if slot is not None else None
            if buffers is None:
                reply = {"error": f"v{version} is not held (newest is v{self._newest})", "newest": self._newest}
                self._socket.send_multipart([identity, json.dumps(reply).encode()])
                continue
            self._socket.send_multipart([identity, json.dumps(message).encode(),
                                         *[memoryview(b.numpy()) for b in buffers]], copy=False)
            self.served += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()


def fetch(address: str, version: int, dest_for, timeout_s: float) -> tuple[dict, FlatBuckets]:
    """Ask `address` for `version` (-1: the newest) and copy its buckets into `dest_for(message)` (FlatBuckets the
    caller owns, chosen once the message says which layout). Returns (message, dest); checksums are the caller's."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        socket.send(json.dumps({"version": version}).encode())
        if not socket.poll(int(timeout_s * 1000)):
            raise CatchupError(f"weight catch-up server {address} did not answer for v{version} within "
                               f"{timeout_s:.0f} s")
        frames = socket.recv_multipart(copy=False)
    finally:
        socket.close(linger=0)
    message = json.loads(frames[0].bytes)
    if "error" in message:
        raise CatchupError(f"weight catch-up server {address}: {message['error']}")
    dest = dest_for(message)
    if len(frames) - 1 != len(dest.buffers):
        raise CatchupError(f"weight catch-up server {address} sent {len(frames) - 1} buckets for v{message['version']}"
                           f", the layout has {len(dest.buffers)}")
    for frame, target in zip(frames[1:], dest.buffers):
        source = np.frombuffer(frame.buffer, dtype=np.uint8)  # read-only view of the received frame
        if source.size != target.numel():
            raise CatchupError(f"weight catch-up server {address}: a bucket of v{message['version']} has "
                               f"{source.size} bytes, the layout says {target.numel()}")
        np.copyto(target.numpy(), source)
    return message, dest
