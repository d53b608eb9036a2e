"""Membership in the learner's TCPStore, shared by both weight data planes that have members: the chain relay
(sender.py / member.py, keys under "ws/") and the push into inference engines (weightsync/engine_push, keys under
"ep/").

Under a prefix P:
- A member registers: `ticket = add("P/tickets", 1)`, then sets "P/member/{ticket}" (id, host, pid, and whatever
  the data plane needs). While it lives, a heartbeat thread bumps "P/hb/{ticket}". It sets "P/left/{ticket}" when it
  closes. A restart registers again under the same member id; the new ticket replaces the old one.
- The learner drops a member whose heartbeat stopped, or that failed a transfer, by setting "P/dropped/{ticket}"
  (the reason); a member that wakes up and sees it registers again.
"""
import json
import logging
import os
import socket
import threading
import time

import torch.distributed as dist

from asyncrl.security.curve import is_loopback
from asyncrl.weightsync.broadcast.protocol import describe_member, timedelta_s

log = logging.getLogger(__name__)


class Roster:
    """The learner's view of the members under one prefix. Not thread-safe: one thread reads and drops."""

    def __init__(self, store: dist.TCPStore, prefix: str, heartbeat_timeout_s: float):
        self.store, self.prefix, self.heartbeat_timeout_s = store, prefix, heartbeat_timeout_s
        self.store.add(f"{prefix}/tickets", 0)
        self.members: dict[int, dict] = {}  # ticket -> registration, of members not yet dropped
        self._scanned = 0  # highest ticket whose registration was read
        self._heartbeats: dict[int, tuple[int, float]] = {}  # ticket -> (last count, monotonic time it changed)

    def live(self, on_drop) -> list[int]:
        """Read new registrations, forget members that left or were replaced by a restart, and drop those whose
        heartbeat stopped (`on_drop(info, reason)` for each). Returns the live tickets in order."""
        newest = int(self.store.add(f"{self.prefix}/tickets", 0))
        for ticket in range(self._scanned + 1, newest + 1):
            if not self.store.check([f"{self.prefix}/member/{ticket}"]):
                break  # registration not written yet; read it next time
            info = json.loads(self.store.get(f"{self.prefix}/member/{ticket}"))
            for old, other in list(self.members.items()):
                if other["member_id"] == info["member_id"]:
                    self.members.pop(old)  # restarted: the new ticket replaces the old one
            self.members[ticket] = info
            self._scanned = ticket
        for ticket, info in list(self.members.items()):
            if self.store.check([f"{self.prefix}/left/{ticket}"]):
                self.members.pop(ticket)
            elif self.stale(ticket):
                reason = f"{describe_member(info)}: no heartbeat for {self.heartbeat_timeout_s} s"
                on_drop(self.drop(ticket, reason), reason)
        return sorted(self.members)

    def stale(self, ticket: int) -> bool:
        count = int(self.store.add(f"{self.prefix}/hb/{ticket}", 0))
        now = time.monotonic()
        last = self._heartbeats.get(ticket)
        if last is None or last[0] != count:
            self._heartbeats[ticket] = (count, now)
            return False
        return now - last[1] > self.heartbeat_timeout_s

    def drop(self, ticket: int, reason: str) -> dict:
        """Remove a member and tell it why (it registers again if it is still alive); returns its registration."""
        info = self.members.pop(ticket)
        self._heartbeats.pop(ticket, None)
        self.store.set(f"{self.prefix}/dropped/{ticket}", reason)
        return info


def warn_if_store_open(host: str, what: str) -> bool:
    """Log a warning when the learner's store binds beyond loopback; True when it did. torch.distributed's TCPStore
    and the process groups it sets up have no authentication, and CURVE keys do not cover them: whoever reaches
    the port can register, be sent every version, and drop or stall members. What generators load stays correct (a
    relayed version is checked against the checksums in the buffer's weights announcement, and a push comes from the
    learner's rank alone), so the harm is disclosure and delay."""
    if is_loopback(host):
        return False
    log.warning("%s: the learner's TCPStore binds %s, and neither it nor the process groups it sets up have "
                "authentication (security.keys_dir does not cover them): anyone who can reach it can join and be "
                "sent every version, or drop members. Bind weightsync.host to a private network the "
                "generators share, or firewall weightsync.broadcast_port and the ranks' ports.", what, host)
    return True


def connect_store(address: str, who: str, timeout_s: float) -> dist.TCPStore:
    """A client of the learner's store at "host:port", or PeerError naming `who` and the address."""
    from asyncrl.weightsync.broadcast.chain import PeerError

    host, port = address.rsplit(":", 1)
    try:
        return dist.TCPStore(host, int(port), None, False, timedelta_s(timeout_s), wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001
        raise PeerError(f"{who}: cannot reach the learner's store at {address} within {timeout_s} s ({exc})") from exc


def register(store: dist.TCPStore, prefix: str, member_id: str, extra: dict | None = None) -> dict:
    """Register under `prefix`; returns the registration (member_id, ticket, pid, host, and `extra`)."""
    ticket = int(store.add(f"{prefix}/tickets", 1))
    info = {"member_id": member_id, "ticket": ticket, "pid": os.getpid(), "host": socket.gethostname(),
            **(extra or {})}
    store.set(f"{prefix}/member/{ticket}", json.dumps(info))
    return info


def start_heartbeat(address: str, prefix: str, ticket_of, period_s: float, stop: threading.Event,
                    name: str) -> threading.Thread:
    """Bump "prefix/hb/{ticket_of()}" every `period_s` on a store client of its own (a thread blocked on the
    member's main client must not stop the beat) until `stop` is set or the learner is gone."""
    host, port = address.rsplit(":", 1)

    def beat():
        try:
            store = dist.TCPStore(host, int(port), None, False, timedelta_s(30), wait_for_workers=False)
        except Exception:  # noqa: BLE001 - the learner is gone; the member's own waits report it
            return
        while not stop.wait(period_s):
            try:
                store.add(f"{prefix}/hb/{ticket_of()}", 1)
            except Exception:  # noqa: BLE001
                return

    thread = threading.Thread(target=beat, daemon=True, name=name)
    thread.start()
    return thread
