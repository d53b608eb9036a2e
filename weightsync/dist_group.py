"""torch.distributed data plane of weight sync: the learner (WeightGroupHost, rank 0) relays each version's buckets
down a chain of generators (WeightGroupMember, ranks 1..N), see weightsync/chain.py.

Membership lives in the learner's TCPStore, and every key is under "ws/":
- A member registers: `ticket = add("ws/tickets", 1)`, then sets "ws/member/{ticket}" (id, host, pid). While it
  lives, a heartbeat thread bumps "ws/hb/{ticket}". It sets "ws/left/{ticket}" when it closes. A restart registers
  again under the same member id; the new ticket replaces the old one.
- Each `send` picks the live members (registered, not left, heartbeat seen within `heartbeat_timeout_s`) in ticket
  order and writes an announcement "ws/send/{seq}" = {version, generation, tickets, bucket sizes, data timeout},
  then bumps "ws/send_seq". Members block on the next announcement key, so the data plane only carries data.
- A changed membership or a failed last send starts a new generation g. Members set "ws/gen{g}/ready/{ticket}",
  the learner waits for all of them, then sets "ws/gen{g}/go". Members missing at the deadline are dropped, and
  the same `send` retries with the rest. Everyone then builds a process group on PrefixStore("ws/gen{g}/pg").
- After the transfer each member sets "ws/ack/{seq}/{ticket}" = {received, error}.

Failure semantics of one `send` (it never raises for a member's failure: it returns a SendReport):
- A member that dies (kill -9) or stalls mid-transfer sends no ack. The learner waits for acks until its deadline,
  or less when every missing member's heartbeat has gone stale. Then it drops that member, names it in
  `report.failed` and `report.dropped`, and sets "ws/dropped/{ticket}" (a stalled member that wakes up sees this
  and registers again).
- Members upstream of the dead one received the version; they are in `report.delivered`. Members downstream of it
  miss this version. Their receive fails with a PeerError naming the dead member, and they stay in the group.
- Any failure ends the generation. The next `send` forms a new one from the survivors (and the restarted members),
  so the next version reaches them. A separate catch-up path serves versions a member missed.
- A member only returns a version once every bucket has arrived in full. A member's bucket set whose receive
  failed may still be written by an aborted peer, so the background receiver never reuses it.
- A member that is alive but slow sets the pace of everyone behind it in the chain (with the background receiver
  it is never "busy", only slow on its link or CPU). If it misses the deadline, it is dropped like a dead one.

Leftovers: a few small keys per registration and per generation (ready, go, the gloo rendezvous) stay in the
store; generations change only when membership does. Announcements and acks are deleted after
KEEP_ANNOUNCEMENTS sends.
"""
import datetime
import json
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from asyncrl.weightsync.chain import (PeerError, abort_process_group, make_process_group, relay_chain,
                                      send_chain)

KEEP_ANNOUNCEMENTS = 16
"""Announcements (and their acks) kept in the store; a member further behind skips to the newest one."""
ACK_POLL_S = 0.002
"""Learner's store polling interval (s) while it waits for acks: one tiny local RPC, far below a transfer."""
ANNOUNCEMENT_POLL_S = 0.005
"""Member's polling interval (s) for the next announcement: adds at most this to a send, costs 200 RPCs/s idle."""


class NoAnnouncement(TimeoutError):
    """No version that includes this member was announced within the timeout; the buckets were not touched."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def describe_member(info: dict, rank: int | None = None) -> str:
    """Name a member in errors the way an operator can find it: id, chain rank, ticket, pid and host."""
    where = f"rank {rank}, " if rank is not None else ""
    return f"member {info['member_id']!r} ({where}ticket {info['ticket']}, pid {info['pid']} on {info['host']})"


@dataclass
class SendReport:
    """What one `WeightGroupHost.send` achieved; member ids are the ones given to `WeightGroupMember.connect`."""
    version: int
    generation: int
    delivered: list[str] = field(default_factory=list)
    """Members that acknowledged the complete version."""
    failed: dict[str, str] = field(default_factory=dict)
    """Members that did not get this version -> why, naming the peer at fault."""
    dropped: list[str] = field(default_factory=list)
    """Members removed from the group as dead or unresponsive (they must register again)."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


class WeightGroupHost:
    """Learner side (rank 0): owns the TCPStore, the membership and the current generation's process group.

    Not thread-safe: call `send` from one thread (the publisher's). Generators never block it for longer than
    `timeout_s` of one send, whatever they do.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str = "gloo",
                 heartbeat_timeout_s: float = 5.0, store_timeout_s: float = 30.0):
        self.backend = backend
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.store = dist.TCPStore(host, port, None, True, _td(store_timeout_s), wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"
        """host:port of the store, for the control plane to hand to generators."""
        self.store.add("ws/tickets", 0)
        self.store.add("ws/send_seq", 0)
        self._members: dict[int, dict] = {}  # ticket -> registration, of members not yet dropped
        self._scanned = 0  # highest ticket whose registration was read
        self._heartbeats: dict[int, tuple[int, float]] = {}  # ticket -> (last count, monotonic time it changed)
        self._chain: list[int] = []  # tickets of the current generation, in rank order
        self._group = None
        self._generation = 0
        self._seq = 0

    def send(self, version: int, buckets: list[torch.Tensor], timeout_s: float, ready=None) -> SendReport:
        """Move `buckets` (same sizes every version) to every live member; returns within about `timeout_s`.
        `ready(k, deadline) -> bool` (optional) blocks until bucket k is filled, so sending starts while the
        caller is still filling later buckets; the membership handshake runs before the first bucket is needed."""
        start = time.monotonic()
        deadline = start + timeout_s
        report = SendReport(version, self._generation)
        sizes = [bucket.numel() * bucket.element_size() for bucket in buckets]
        while True:
            chain = self._select_live_members(report)
            if not chain:
                report.seconds = time.monotonic() - start
                return report
            new_generation = self._group is None or chain != self._chain
            if new_generation:
                self._end_generation()
                self._generation += 1
            report.generation = self._generation
            seq = self._announce(version, chain, new_generation, sizes, deadline)
            if not new_generation or self._form_generation(seq, chain, deadline, report):
                break
            if time.monotonic() >= deadline:
                report.seconds = time.monotonic() - start
                return report
        if self._group is not None:
            self._transfer(seq, buckets, deadline, report, ready)
        report.seconds = time.monotonic() - start
        return report

    def close(self) -> None:
        """Drop the process group; the store (and with it every member's connection) ends with this object."""
        self._end_generation()

    def _select_live_members(self, report: SendReport) -> list[int]:
        """Read new registrations and drop members that left, were replaced by a restart, or stopped beating."""
        newest = int(self.store.add("ws/tickets", 0))
        for ticket in range(self._scanned + 1, newest + 1):
            if not self.store.check([f"ws/member/{ticket}"]):
                break  # registration not written yet; read it next time
            info = json.loads(self.store.get(f"ws/member/{ticket}"))
            for old, other in list(self._members.items()):
                if other["member_id"] == info["member_id"]:
                    self._members.pop(old)  # restarted: the new ticket replaces the old one
            self._members[ticket] = info
            self._scanned = ticket
        for ticket, info in list(self._members.items()):
            if self.store.check([f"ws/left/{ticket}"]):
                self._members.pop(ticket)
            elif self._heartbeat_stale(ticket):
                self._drop(ticket, f"{describe_member(info)}: no heartbeat for {self.heartbeat_timeout_s} s", report)
        return sorted(self._members)

    def _heartbeat_stale(self, ticket: int) -> bool:
        count = int(self.store.add(f"ws/hb/{ticket}", 0))
        now = time.monotonic()
        last = self._heartbeats.get(ticket)
        if last is None or last[0] != count:
            self._heartbeats[ticket] = (count, now)
            return False
        return now - last[1] > self.heartbeat_timeout_s

    def _drop(self, ticket: int, reason: str, report: SendReport) -> None:
        info = self._members.pop(ticket)
        self._heartbeats.pop(ticket, None)
        self.store.set(f"ws/dropped/{ticket}", reason)
        report.failed[info["member_id"]] = reason
        report.dropped.append(info["member_id"])

    def _announce(self, version: int, chain: list[int], new_generation: bool, sizes: list[int],
                  deadline: float) -> int:
        """Publish what the next transfer is; members get 90% of the time left so their acks beat our deadline."""
        self._seq += 1
        data_timeout_s = 0.9 * (deadline - time.monotonic())
        message = {"version": version, "generation": self._generation, "tickets": chain,
                   "new_generation": new_generation, "sizes": sizes, "data_timeout_s": data_timeout_s}
        self.store.set(f"ws/send/{self._seq}", json.dumps(message))
        self.store.add("ws/send_seq", 1)
        self._forget(self._seq - KEEP_ANNOUNCEMENTS)
        return self._seq

    def _forget(self, seq: int) -> None:
        if seq >= 1 and self.store.check([f"ws/send/{seq}"]):
            for ticket in json.loads(self.store.get(f"ws/send/{seq}"))["tickets"]:
                self.store.delete_key(f"ws/ack/{seq}/{ticket}")
            self.store.delete_key(f"ws/send/{seq}")

    def _form_generation(self, seq: int, chain: list[int], deadline: float, report: SendReport) -> bool:
        """Ready barrier, then the group. False: someone was missing and got dropped; retry with the rest."""
        prefix = f"ws/gen{self._generation}"
        ready = {ticket: f"{prefix}/ready/{ticket}" for ticket in chain}
        missing = self._wait_keys(ready, deadline)
        if missing:
            self.store.set(f"{prefix}/go", json.dumps({"ok": False}))
            for ticket in missing:
                rank = chain.index(ticket) + 1
                self._drop(ticket, f"{describe_member(self._members[ticket], rank)}: not ready for generation "
                                   f"{self._generation} (dead or stalled)", report)
            return False
        self.store.set(f"{prefix}/go", json.dumps({"ok": True}))
        try:
            self._group = make_process_group(self.backend, dist.PrefixStore(f"{prefix}/pg", self.store), 0,
                                             len(chain) + 1, deadline - time.monotonic())
        except Exception as exc:  # noqa: BLE001 - a member died between "ready" and the rendezvous
            names = ", ".join(describe_member(self._members[t], i + 1) for i, t in enumerate(chain))
            for ticket in chain:
                report.failed[self._members[ticket]["member_id"]] = (
                    f"rendezvous of generation {self._generation} with {names} failed: {exc}")
            return True
        self._chain = chain
        return True

    def _wait_keys(self, keys: dict[int, str], deadline: float) -> list[int]:
        """Wait for one key per ticket; stop early once every missing ticket's heartbeat is stale.

        Polls `check` instead of `store.wait` with short timeouts, which would log a c10d warning each time.
        """
        pending = dict(keys)
        next_review = time.monotonic() + 0.25
        while pending and not self.store.check(list(pending.values())):
            now = time.monotonic()
            if now >= next_review or now >= deadline:
                pending = {t: k for t, k in pending.items() if not self.store.check([k])}
                if now >= deadline or (pending and all(self._heartbeat_stale(t) for t in pending)):
                    return sorted(pending)
                next_review = now + 0.25
            time.sleep(ACK_POLL_S)
        return []

    def _transfer(self, seq: int, buckets: list[torch.Tensor], deadline: float, report: SendReport,
                  ready=None) -> None:
        chain = self._chain
        try:
            send_chain(self._group, buckets, deadline, describe_member(self._members[chain[0]], 1), ready)
        except PeerError as exc:
            report.failed[self._members[chain[0]]["member_id"]] = str(exc)
        acks = {ticket: f"ws/ack/{seq}/{ticket}" for ticket in chain}
        missing = self._wait_keys(acks, deadline)
        for ticket in chain:
            info = self._members[ticket]
            if ticket in missing:
                continue
            ack = json.loads(self.store.get(acks[ticket]))
            if ack["received"]:
                report.delivered.append(info["member_id"])
                report.failed.pop(info["member_id"], None)  # our send error was a late echo of a forward error
            else:
                report.failed[info["member_id"]] = ack["error"]
            if ack["error"] is not None or not ack["received"]:
                self._end_generation()  # someone in the chain saw a failure: re-form next time
        for ticket in missing:
            reason = (f"{describe_member(self._members[ticket], chain.index(ticket) + 1)}: no acknowledgement of "
                      f"version {report.version} in time (dead or stalled)")
            self._drop(ticket, reason, report)
            self._end_generation()

    def _end_generation(self) -> None:
        abort_process_group(self._group)
        self._group, self._chain = None, []


class WeightGroupMember:
    """Generator side (rank >= 1). Use either `receive` (blocking, one version) or `start_receiving` (a background
    thread that is always ready, so the learner never waits on a busy engine), never both at once."""

    def __init__(self, store: dist.TCPStore, address: str, member_id: str, backend: str, heartbeat_s: float):
        self.store, self.address, self.member_id, self.backend = store, address, member_id, backend
        self.heartbeat_s = heartbeat_s
        self.info: dict = {}
        self._group, self._generation, self._next_seq = None, 0, 1
        self._stop = threading.Event()
        self._register()
        self._heartbeat = threading.Thread(target=self._beat, args=(self._client(),), daemon=True,
                                           name=f"weightsync-heartbeat-{member_id}")
        self._heartbeat.start()
        self._receiver = None
        self._lock = threading.Lock()
        self._latest, self._free = None, []
        self.errors: deque = deque(maxlen=32)
        """Recent failed receives (each names the peer); the background thread keeps going after them."""
        self.fatal: BaseException | None = None
        """Set when the background thread stopped for good (e.g. the learner's store went away)."""

    @classmethod
    def connect(cls, address: str, member_id: str, timeout_s: float, backend: str = "gloo",
                heartbeat_s: float = 0.5) -> "WeightGroupMember":
        """Join the learner's store at "host:port" and register; joins the group at the next `send`."""
        host, port = address.rsplit(":", 1)
        try:
            store = dist.TCPStore(host, int(port), None, False, _td(timeout_s), wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001
            raise PeerError(f"member {member_id!r}: cannot reach the learner's store at {address} within "
                            f"{timeout_s} s ({exc})") from exc
        return cls(store, address, member_id, backend, heartbeat_s)

    def _client(self) -> dist.TCPStore:
        host, port = self.address.rsplit(":", 1)
        return dist.TCPStore(host, int(port), None, False, _td(30), wait_for_workers=False)

    def _register(self) -> None:
        ticket = int(self.store.add("ws/tickets", 1))
        self.info = {"member_id": self.member_id, "ticket": ticket, "pid": os.getpid(), "host": socket.gethostname()}
        self.store.set(f"ws/member/{ticket}", json.dumps(self.info))
        self._next_seq = max(1, int(self.store.add("ws/send_seq", 0)))

    def _beat(self, store: dist.TCPStore) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                store.add(f"ws/hb/{self.info['ticket']}", 1)
            except Exception:  # noqa: BLE001 - the learner is gone; the receiver reports it
                return

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
            self.store.wait([f"{prefix}/go"], _td(deadline - time.monotonic()))
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
