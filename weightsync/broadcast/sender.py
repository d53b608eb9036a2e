"""The learner's side of the weight group (rank 0): membership, generations and each version's send down the
chain. The protocol, and its failure semantics, are in protocol.py."""
import json
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from asyncrl.weightsync.broadcast.chain import PeerError, abort_process_group, make_process_group, send_chain
from asyncrl.weightsync.broadcast.protocol import ACK_POLL_S, KEEP_ANNOUNCEMENTS, describe_member, timedelta_s
from asyncrl.weightsync.broadcast.roster import Roster, warn_if_store_open


@dataclass
class SendReport:
    """What one `BroadcastSender.send` achieved; member ids are the ones given to `BroadcastMember.connect`."""
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


class BroadcastSender:
    """Learner side (rank 0): owns the TCPStore, the membership and the current generation's process group.

    Not thread-safe: call `send` from one thread (the publisher's). Generators never block it for longer than
    `timeout_s` of one send, whatever they do.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str = "gloo",
                 heartbeat_timeout_s: float = 5.0, store_timeout_s: float = 30.0):
        self.backend = backend
        self.heartbeat_timeout_s = heartbeat_timeout_s
        warn_if_store_open(host, "weightsync.backend=broadcast")
        self.store = dist.TCPStore(host, port, None, True, timedelta_s(store_timeout_s), wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"
        """host:port of the store, for the control plane to hand to generators."""
        self.roster = Roster(self.store, "ws", heartbeat_timeout_s)
        self._members = self.roster.members  # ticket -> registration, of members not yet dropped
        self.store.add("ws/send_seq", 0)
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
        def dropped(info: dict, reason: str) -> None:
            report.failed[info["member_id"]] = reason
            report.dropped.append(info["member_id"])

        return self.roster.live(dropped)

    def _heartbeat_stale(self, ticket: int) -> bool:
        return self.roster.stale(ticket)

    def _drop(self, ticket: int, reason: str, report: SendReport) -> None:
        info = self.roster.drop(ticket, reason)
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
