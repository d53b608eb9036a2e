"""A generator's side of the weight group (rank >= 1): registration, heartbeat, and receiving each announced
version from its upstream neighbour while relaying it downstream. The protocol is in protocol.py."""
import json
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from asyncrl.weightsync.broadcast.chain import PeerError, abort_process_group, make_process_group, relay_chain
from asyncrl.weightsync.broadcast.protocol import (ANNOUNCEMENT_POLL_S, KEEP_ANNOUNCEMENTS, NoAnnouncement, describe_member,
                                           timedelta_s)
from asyncrl.weightsync.broadcast.roster import connect_store, register, start_heartbeat


class BroadcastMember:
    """Generator side (rank >= 1). Use either `receive` (blocking, one version) or `start_receiving` (a background
    thread that is always ready, so the learner never waits on a busy engine), never both at once."""

    def __init__(self, store: dist.TCPStore, address: str, member_id: str, backend: str, heartbeat_s: float):
        self.store, self.address, self.member_id, self.backend = store, address, member_id, backend
        self.heartbeat_s = heartbeat_s
        self.info: dict = {}
        self._group, self._generation, self._next_seq = None, 0, 1
        self._stop = threading.Event()
        self._register()
        self._heartbeat = start_heartbeat(address, "ws", lambda: self.info["ticket"], heartbeat_s, self._stop,
                                          f"weightsync-heartbeat-{member_id}")
        self._receiver = None
        self._lock = threading.Lock()
        self._latest, self._free = None, []
        self.errors: deque = deque(maxlen=32)
        """Recent failed receives (each names the peer); the background thread keeps going after them."""
        self.fatal: BaseException | None = None
        """Set when the background thread stopped for good (e.g. the learner's store went away)."""

    @classmethod
    def connect(cls, address: str, member_id: str, timeout_s: float, backend: str = "gloo",
                heartbeat_s: float = 0.5) -> "BroadcastMember":
        """Join the learner's store at "host:port" and register; joins the group at the next `send`."""
        store = connect_store(address, f"member {member_id!r}", timeout_s)
        return cls(store, address, member_id, backend, heartbeat_s)

    def _register(self) -> None:
        self.info = register(self.store, "ws", self.member_id)
        self._next_seq = max(1, int(self.store.add("ws/send_seq", 0)))

    def receive(self, buckets: list[torch.Tensor], timeout_s: float) -> int:
        """Wait up to `timeout_s` for a version that includes this member, fill `buckets` in place (forwarding
        each to the next member), and return the version.

        Raises NoAnnouncement if none came (buckets untouched), PeerError naming the peer if the transfer failed
        (buckets partly written: do not use them), ValueError if the bucket sizes differ from the learner's.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            seq, message = self._wait_announcement(deadline)
            tickets = message["tickets"]
            if self.info["ticket"] not in tickets:
                if self.store.check([f"ws/dropped/{self.info['ticket']}"]):
                    self._abandon_generation()
                    self._register()  # dropped as unresponsive: come back as a new member
                continue
            rank = tickets.index(self.info["ticket"]) + 1
            data_deadline = time.monotonic() + message["data_timeout_s"]
            try:
                self._check_sizes(buckets, message["sizes"])
                if message["new_generation"]:
                    if not self._join_generation(message["generation"], rank, len(tickets) + 1, data_deadline):
                        continue
                elif self._group is None or message["generation"] != self._generation:
                    raise PeerError(f"{self._me(rank)} is not in generation {message['generation']} of the "
                                    f"learner at {self.address}")
                upstream = self._peer(tickets, rank - 1)
                downstream = self._peer(tickets, rank + 1) if rank < len(tickets) else None
                forward_error = relay_chain(self._group, rank, buckets, data_deadline, upstream, downstream)
            except (PeerError, ValueError) as exc:
                self._abandon_generation()
                self._ack(seq, received=False, error=f"{self._me(rank)}: {exc}")
                raise
            if forward_error is not None:
                self._abandon_generation()
            self._ack(seq, received=True, error=forward_error)
            return message["version"]

    def _wait_announcement(self, deadline: float) -> tuple[int, dict]:
        newest = int(self.store.add("ws/send_seq", 0))
        self._next_seq = max(self._next_seq, newest - KEEP_ANNOUNCEMENTS + 1)
        key = f"ws/send/{self._next_seq}"
        while not self.store.check([key]):
            if time.monotonic() >= deadline or self._stop.wait(ANNOUNCEMENT_POLL_S):
                raise NoAnnouncement(f"{self._me()}: no weight version announced by the learner at "
                                     f"{self.address} (waiting for announcement {self._next_seq})")
        self._next_seq += 1
        return self._next_seq - 1, json.loads(self.store.get(key))

    def _join_generation(self, generation: int, rank: int, size: int, deadline: float) -> bool:
        """Ready barrier then rendezvous; False when the learner called this generation off (someone missing)."""
        self._abandon_generation()
        prefix = f"ws/gen{generation}"
        self.store.set(f"{prefix}/ready/{self.info['ticket']}", "1")
        try:
            self.store.wait([f"{prefix}/go"], timedelta_s(deadline - time.monotonic()))
        except dist.DistStoreError as exc:
            raise PeerError(f"no go for generation {generation} from the learner at {self.address}") from exc
        if not json.loads(self.store.get(f"{prefix}/go"))["ok"]:
            return False
        try:
            self._group = make_process_group(self.backend, dist.PrefixStore(f"{prefix}/pg", self.store), rank,
                                             size, deadline - time.monotonic())
        except Exception as exc:  # noqa: BLE001
            raise PeerError(f"rendezvous of generation {generation} ({size} ranks, store {self.address}) "
                            f"failed: {exc}") from exc
        self._generation = generation
        return True

    def _peer(self, tickets: list[int], rank: int) -> str:
        if rank == 0:
            return f"the learner (rank 0, store {self.address})"
        key = f"ws/member/{tickets[rank - 1]}"
        return describe_member(json.loads(self.store.get(key)), rank)

    def _me(self, rank: int | None = None) -> str:
        return describe_member(self.info, rank)

    @staticmethod
    def _check_sizes(buckets: list[torch.Tensor], sizes: list[int]) -> None:
        mine = [bucket.numel() * bucket.element_size() for bucket in buckets]
        if mine != sizes:
            raise ValueError(f"bucket sizes {mine} differ from the learner's {sizes}")

    def _ack(self, seq: int, received: bool, error: str | None) -> None:
        self.store.set(f"ws/ack/{seq}/{self.info['ticket']}", json.dumps({"received": received, "error": error}))

    def _abandon_generation(self) -> None:
        abort_process_group(self._group)
        self._group = None

    # --- background receiving -------------------------------------------------------------------------------

    def start_receiving(self, alloc_buckets_fn, on_version_fn=None, poll_s: float = 5.0) -> None:
        """Receive every version in a daemon thread into bucket sets from `alloc_buckets_fn()` (a fresh
        list of preallocated buckets per call).

        `on_version_fn(version)` runs in that thread after each complete version and must return quickly (e.g.
        set an event). The engine then calls `take_latest()` and, once it has loaded the weights, `release()`.
        At most three sets exist when the engine releases before taking again: one receiving, one latest, one
        being loaded. A superseded latest set is reused; a set whose receive failed is discarded.
        """
        def loop():
            while not self._stop.is_set():
                with self._lock:
                    buckets = self._free.pop() if self._free else None
                buckets = buckets if buckets is not None else alloc_buckets_fn()
                try:
                    version = self.receive(buckets, poll_s)
                except NoAnnouncement:
                    with self._lock:
                        self._free.append(buckets)
                    continue
                except (PeerError, ValueError) as exc:
                    self.errors.append(str(exc))
                    continue
                except Exception as exc:  # noqa: BLE001 - the store is gone: nothing more will arrive
                    self.fatal = exc
                    return
                with self._lock:
                    if self._latest is not None:
                        self._free.append(self._latest[1])
                    self._latest = (version, buckets)
                if on_version_fn is not None:
                    on_version_fn(version)

        self._receiver = threading.Thread(target=loop, daemon=True, name=f"weightsync-recv-{self.member_id}")
        self._receiver.start()

    def take_latest(self) -> tuple[int, list[torch.Tensor]] | None:
        """The newest complete (version, buckets) not taken yet, or None; the caller owns it until `release`."""
        with self._lock:
            latest, self._latest = self._latest, None
        return latest

    def release(self, buckets: list[torch.Tensor]) -> None:
        """Give a taken bucket set back for reuse."""
        with self._lock:
            self._free.append(buckets)

    def close(self) -> None:
        """Stop the threads, tell the learner we left (it re-forms the group at its next send), drop the group."""
        self._stop.set()
        if self._receiver is not None:
            self._receiver.join()
        try:
            self.store.set(f"ws/left/{self.info['ticket']}", "1")
        except Exception:  # noqa: BLE001 - the learner is gone already
            pass
        self._abandon_generation()
