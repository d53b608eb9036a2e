"""torch.distributed data plane of weight sync: the learner (host.BroadcastSender, rank 0) relays each
version's buckets down a chain of generators (member.BroadcastMember, ranks 1..N), see chain.py.
This module holds the protocol both sides follow, and what they share.

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

KEEP_ANNOUNCEMENTS = 16
"""Announcements (and their acks) kept in the store; a member further behind skips to the newest one."""
ACK_POLL_S = 0.002
"""Learner's store polling interval (s) while it waits for acks: one tiny local RPC, far below a transfer."""
ANNOUNCEMENT_POLL_S = 0.005
"""Member's polling interval (s) for the next announcement: adds at most this to a send, costs 200 RPCs/s idle."""


class NoAnnouncement(TimeoutError):
    """No version that includes this member was announced within the timeout; the buckets were not touched."""


def timedelta_s(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def describe_member(info: dict, rank: int | None = None) -> str:
    """Name a member in errors the way an operator can find it: id, chain rank, ticket, pid and host."""
    where = f"rank {rank}, " if rank is not None else ""
    return f"member {info['member_id']!r} ({where}ticket {info['ticket']}, pid {info['pid']} on {info['host']})"
