"""The durable buffer: groups in one Redis Stream, consumed by the learner through a consumer group.

Keys share the hash tag `{job}` (one cluster slot): `asyncrl:{job}:groups` (the stream),
`asyncrl:{job}:seen:<group_id>` (idempotence marks, expiring), `asyncrl:{job}:dead` (the dead-letter stream),
`asyncrl:{job}:duplicates` (how many resent deliveries were dropped).

Delivery protocol (at-least-once delivery + idempotent training = each admitted group trained exactly once):
1. A producer adds a batch of groups in one MULTI/EXEC. Per group: a plain XADD of the payload with a fresh attempt
   token, then DELIVER, a small script that marks the group id as delivered by this token (`seen:<group_id>`) and
   releases the group's admission lease, unless the mark already exists. The mark, the entry and the release are
   written together or not at all. A resend after a lost reply adds a second entry, and its DELIVER finds the
   first attempt's mark, releases nothing, and deletes that second entry: the stream's last entry, added just
   before in the same MULTI, which nothing can interleave (checked by its token). So no reader ever sees a
   duplicate, and every entry in the stream is its group's only one. Why the payload is not checked and added
   inside one script: a Lua argument costs Redis time linear in its size, about 2 us per KB measured here (140 us
   of Redis's single thread for a 64 KB group even in a script that ignores it, against 20 us for a plain XADD);
   only a duplicate, which is rare, reads its entry back into Lua.
2. The learner reads new entries with XREADGROUP (`>`); after a restart it first re-reads the entries still pending
   for its consumer name (`0`), and entries pending for a consumer that died are taken over with XAUTOCLAIM.
3. The learner trains, and XACKs an entry only after a checkpoint covering the optimizer step that used it is on
   disk. A crash before that leaves the entry pending, so it is delivered again and retrained from the restored
   checkpoint, whose weights never saw it.
4. A crash between the checkpoint and the XACK would deliver a group the checkpoint already covers. The checkpoint
   records the entry ids it covers; on restart those are acked without training (`ack`) — the idempotent half.
5. An entry that cannot be decoded, or that was delivered `max_deliveries` times, goes to the dead-letter stream with
   its reason and is acked, so one poison message never blocks the learner.
Trimming removes only entries older than the oldest pending one (or, with none pending, than the group's last
delivered id): every removed entry was delivered and acked, so nothing unconsumed is ever deleted.
"""
import logging
import uuid
from typing import NamedTuple

import redis

from asyncrl.buffer.redis.reconnect import direct

log = logging.getLogger(__name__)
GROUP = "learner"
PAYLOAD = b"g"
TOKEN = b"a"
LEASE = b"l"
"""The admission lease the delivery released ('' for a group sent without one): a dropped group gives its
admission back only if it held one."""
PRODUCER = b"p"
"""The generator id of the client that added the entry: a group must carry it (one identity)."""
DEAL = b"d"
"""The dealt prompt the group answers ('' when the learner deals none; dealing.py): DELIVER accepted it as out to
the producer, and the learner resolves it even when the payload cannot be decoded."""
REFUSED = "!deal"
"""DELIVER's answer for a group whose deal is not out to its producer (expired and dealt again, never dealt, or
already delivered): the entry is deleted and its lease given back."""
DEAD_LETTER_PAYLOAD_BYTES = 64 << 10
ACK_REFUSED = """local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 1 then redis.call('HINCRBY', KEYS[2], 'refused', 1) end
return acked"""
"""Ack an entry refused for its deal and count it in the data cursor's `refused` (data/refused), only if this ack took
it: `dead_letter` is resent whole after a lost reply."""
DELIVER = """
-- KEYS[1] the group's mark, KEYS[2] leases, KEYS[3] started, KEYS[4] the stream, KEYS[5] the duplicates count,
-- KEYS[6] the deals out, KEYS[7] the deals' holders, KEYS[8] the data cursor (dealing.py);
-- ARGV[1] this attempt's token, ARGV[2] mark ttl (s), ARGV[3] lease id ('' for none), ARGV[4] deal id ('' for
-- none), ARGV[5] the producer. Runs right after this attempt's XADD in one MULTI. Returns the first attempt's token
-- if the group was delivered before, the refusal marker if its deal is not out to the producer (deleting this
-- attempt's entry either way), else false.
local function drop_this_attempt()
  -- this attempt's entry (fields g, payload, a, token, ...) is the stream's last one
  local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)[1]
  if last and last[2][4] == ARGV[1] then
    redis.call('XDEL', KEYS[4], last[1])
    return true
  end
  return false
end
local first = redis.call('GET', KEYS[1])
if first then
  if drop_this_attempt() then redis.call('INCR', KEYS[5]) end
  return first
end
if ARGV[4] ~= '' then
  if redis.call('HGET', KEYS[7], ARGV[4]) ~= ARGV[5] or redis.call('ZREM', KEYS[6], ARGV[4]) == 0 then
    drop_this_attempt()
    if ARGV[3] ~= '' and redis.call('ZREM', KEYS[2], ARGV[3]) == 1 then
      local left = tonumber(redis.call('GET', KEYS[3]) or '0') - 1
      if left < 0 then left = 0 end
      redis.call('SET', KEYS[3], left)
    end
    redis.call('HINCRBY', KEYS[8], 'refused', 1)
    return '!deal'
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if ARGV[3] ~= '' and redis.call('ZREM', KEYS[2], ARGV[3]) == 0 then
  -- its lease had expired and been given back: it counts as started again
  redis.call('INCR', KEYS[3])
end
return false
"""
DELIVER_BODY = "\n".join(line for line in DELIVER.splitlines() if line.strip() and not line.lstrip().startswith("--"))
"""DELIVER as sent: EVAL with the body, not EVALSHA. A registered script on a pipeline makes redis-py ask SCRIPT
EXISTS before every batch (one more round trip each), and an EVALSHA inside MULTI that meets NOSCRIPT (Redis
restarted) fails alone while the XADD beside it is applied: a group entry without its mark. EVAL cannot miss; Redis
hashes the short body (comments stripped) and reuses the compiled script."""


def job_keys(job: str) -> dict:
    prefix = f"asyncrl:{{{job}}}:"
    names = ("groups", "dead", "version", "started", "leases", "meta", "duplicates", "rejections", "refused")
    return {name: prefix + name for name in names} | {f"data_{name}": f"{prefix}data:{name}" for name in DATA_KEYS} | {
        "seen": prefix + "seen:", "grant": prefix + "grant:", "given": prefix + "given:"}


DATA_KEYS = ("cursor", "returned", "ready", "place", "row", "holder", "out", "returned_by", "filtered", "resolved")
"""The prompt dealer's state (dealing.py), as `job_keys` names it: `data_<name>`."""


class Entry(NamedTuple):
    """A stream entry as read: its id, the encoded group, the delivery attempt's token (step 1), the lease it
    released and the generator that added it."""
    entry_id: bytes
    payload: bytes
    token: bytes | None
    lease: bytes = b""
    producer: bytes = b""
    deal: bytes = b""

    @classmethod
    def of(cls, entry_id: bytes, fields: dict | None) -> "Entry":
        fields = fields or {}
        return cls(entry_id, fields.get(PAYLOAD, b""), fields.get(TOKEN), fields.get(LEASE, b""),
                   fields.get(PRODUCER, b""), fields.get(DEAL, b""))


class GroupStream:
    """One job's stream of encoded groups. `consumer` names this reader (the learner uses `learner-0`); `producer`
    is the generator id written with every entry this writer adds."""

    def __init__(self, client, job: str, consumer: str = "learner-0", mark_ttl_s: int = 7 * 24 * 3600,
                 max_deliveries: int = 5, retry=direct, producer: str = "", on_poison=None):
        self.client = client
        self.producer = producer
        self.on_poison = on_poison
        """Called with (the Entry, its deliveries) for each entry dead-lettered after max_deliveries, so the learner
        counts it with its other rejections and gives its admission back."""
        self.retry = retry
        """Runs each Redis operation (redis_reconnect.Reconnecting rides out a restart; every one here is
        idempotent, see the module doc of redis_reconnect)."""
        self.keys = job_keys(job)
        self.consumer = consumer
        self.mark_ttl_s = mark_ttl_s
        self.max_deliveries = max_deliveries
        self._pending_cursor = b"0"  # where re-reading this consumer's pending entries continues; None when done

    def ensure_group(self) -> bool:
        """Create the stream and the learner's consumer group (from the beginning) if they do not exist; True if
        it had to be created."""
        return self.retry("XGROUP CREATE", self.create_group)

    def create_group(self) -> bool:
        """ensure_group without retrying (for code that runs inside a retry, such as a reconnect listener)."""
        try:
            self.client.xgroup_create(self.keys["groups"], GROUP, id="0", mkstream=True)
            return True
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
            return False

    def restart_pending(self) -> None:
        """Re-read this consumer's pending entries before new ones: after a reply lost to a dropped connection,
        entries may have been delivered to us without our seeing them (the reader skips those it already holds)."""
        self._pending_cursor = b"0"

    def produce(self, group_id: str, payload: bytes, lease_id: str = "", deal: str = "") -> bytes | None:
        """Add one group unless this group id was added before; returns the entry id, None for a duplicate, or
        REFUSED. (A generator adds its deliveries in batches: redis_produce.produce_batch.)"""
        def once():
            pipe = self.client.pipeline(transaction=True)
            self.add(pipe, group_id, payload, lease_id, deal)
            return self.settle(pipe.execute())[0]

        return self.retry("produce (XADD)", once)

    def add(self, pipe, group_id: str, payload: bytes, lease_id: str = "", deal: str = "") -> None:
        """Queue one delivery (step 1 of the protocol) on a MULTI pipeline: two replies, for `settle`."""
        token = uuid.uuid4().hex  # field order matters: DELIVER finds the token as the entry's 4th item
        pipe.xadd(self.keys["groups"], {PAYLOAD: payload, TOKEN: token, LEASE: lease_id, PRODUCER: self.producer,
                                        DEAL: deal})
        pipe.eval(DELIVER_BODY, 8, self.keys["seen"] + group_id, self.keys["leases"], self.keys["started"],
                  self.keys["groups"], self.keys["duplicates"], self.keys["data_out"], self.keys["data_holder"],
                  self.keys["data_cursor"], token, self.mark_ttl_s, lease_id, deal, self.producer)

    @staticmethod
    def settle(replies: list) -> list:
        """From the replies of the `add`s, in order: each entry id, None where the group was delivered before, or
        REFUSED where its deal was not out to this producer (DELIVER already deleted that attempt's entry)."""
        return [REFUSED if first in (REFUSED, REFUSED.encode()) else None if first else entry_id
                for entry_id, first in zip(replies[::2], replies[1::2])]

    def duplicates(self) -> int:
        """Resent deliveries dropped so far (each found its group's first attempt already in the stream)."""
        return int(self.retry("GET duplicates", self.client.get, self.keys["duplicates"]) or 0)

    def read(self, count: int, block_ms: int, held: frozenset = frozenset()) -> list["Entry"]:
        """Up to `count` entries: first whatever is still pending for this consumer from before a restart (each
        re-read counts as a delivery, so one that keeps killing its learner is dead-lettered after max_deliveries;
        `held` are entries this reader still works on, never counted against it), then new entries (blocking up
        to block_ms)."""
        while self._pending_cursor is not None:
            reply = self._xreadgroup(self._pending_cursor, count, None)
            entries = reply[0][1] if reply else []
            if not entries:
                self._pending_cursor = None
                break
            self._pending_cursor = entries[-1][0]
            pending = self._with_payloads([(entry_id, fields) for entry_id, fields in entries
                                           if entry_id not in held], check_deliveries=True)
            pending += [Entry.of(entry_id, fields) for entry_id, fields in entries if entry_id in held]
            if pending:
                return pending
        reply = self._xreadgroup(b">", count, block_ms)
        return self._with_payloads(reply[0][1] if reply else [])

    def _xreadgroup(self, cursor: bytes, count: int, block_ms: int | None):
        return self.retry("XREADGROUP", self.client.xreadgroup, GROUP, self.consumer, {self.keys["groups"]: cursor},
                          count=count, block=block_ms)

    def _with_payloads(self, entries: list, check_deliveries: bool = False) -> list["Entry"]:
        """Entries that still hold a payload (one pending but already trimmed away is acked: nothing is left to
        train), without the over-delivered ones when `check_deliveries`."""
        live = []
        for entry_id, fields in entries:
            if not fields:
                self.ack([entry_id])
                continue
            live.append((entry_id, fields))
        return self._without_poison(live) if check_deliveries else [Entry.of(entry_id, f) for entry_id, f in live]

    def ack(self, entry_ids: list, resolved_deals: list = ()) -> int:
        """XACK; with `resolved_deals` (deals the learner resolved while these entries were pending) their marks in
        `data:resolved` go in the same transaction (dealing.py: an entry met again is skipped only with one)."""
        if not entry_ids:
            return 0
        if not resolved_deals:
            return self.retry("XACK", self.client.xack, self.keys["groups"], GROUP, *entry_ids)

        def once():
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(self.keys["groups"], GROUP, *entry_ids).hdel(self.keys["data_resolved"], *resolved_deals)
            return pipe.execute()[0]

        return self.retry("XACK", once)

    def dead_letter(self, entry_id: bytes, payload: bytes, reason: str, refused_deal: bool = False,
                    resolved_deal: bytes = b"") -> None:
        """Move an entry to the dead-letter stream with its reason, and ack it, in one transaction. Only the first
        DEAD_LETTER_PAYLOAD_BYTES of the payload are kept (with its size): enough to see what it was, and 10,000
        dead letters of near-limit groups would otherwise hold 160 GB. `refused_deal`: the entry does not answer
        its deal, counted with DELIVER's refusals in the data cursor's `refused` (data/refused), in the same
        transaction, so a refusal is counted once whoever refuses it. `resolved_deal`: the entry's deal, resolved by
        the learner just before; its mark in `data:resolved` goes with the entry (see `ack`)."""
        def move():  # resent after a lost reply, the dead-letter stream may hold the entry twice; never zero times
            pipe = self.client.pipeline(transaction=True)
            pipe.xadd(self.keys["dead"], {"entry": entry_id, "reason": reason[:1000], "size": len(payload),
                                          "payload": payload[:DEAD_LETTER_PAYLOAD_BYTES]},
                      maxlen=10_000, approximate=True)
            if refused_deal:  # counted only by the attempt whose ack took the entry: a resend counts nothing
                pipe.eval(ACK_REFUSED, 2, self.keys["groups"], self.keys["data_cursor"], GROUP, entry_id)
            else:
                pipe.xack(self.keys["groups"], GROUP, entry_id)
            if resolved_deal:
                pipe.hdel(self.keys["data_resolved"], resolved_deal)
            pipe.execute()

        self.retry("dead-letter", move)

    def payload_of(self, entry_id: bytes) -> bytes:
        """An entry's encoded group (b"" if it is gone)."""
        rows = self.retry("XRANGE", self.client.xrange, self.keys["groups"], entry_id, entry_id)
        return rows[0][1].get(PAYLOAD, b"") if rows else b""

    def touch(self, entry_ids: list) -> None:
        """Reset the idle time of entries this consumer still holds (read, training, not yet covered by a
        checkpoint), without counting a delivery, so `reclaim` never takes them back from a live learner."""
        for start in range(0, len(entry_ids), 1000):
            self.retry("XCLAIM JUSTID", self.client.xclaim, self.keys["groups"], GROUP, self.consumer, 0,
                       entry_ids[start:start + 1000], justid=True)

    def reclaim(self, min_idle_ms: int, count: int = 100, held: frozenset = frozenset()) -> list["Entry"]:
        """Entries pending for any consumer idle longer than min_idle_ms, now owned by this one, except those in
        `held` (this consumer is still working on them). Those delivered max_deliveries times already go to the
        dead-letter stream instead."""
        _, claimed, deleted = self.retry("XAUTOCLAIM", self.client.xautoclaim, self.keys["groups"], GROUP,
                                         self.consumer, min_idle_ms, start_id="0-0", count=count)[:3]
        if deleted:
            self.ack(list(deleted))
        return self._without_poison([(entry_id, fields) for entry_id, fields in claimed if entry_id not in held])

    def _without_poison(self, entries: list) -> list["Entry"]:
        """The entries, except those delivered more than max_deliveries times, which go to the dead-letter stream:
        an entry on which every learner that reads it dies (or fails its step) is not replayed forever."""
        counts = self.delivery_counts([entry_id for entry_id, _ in entries])
        out = []
        for entry_id, fields in entries:
            if counts.get(entry_id, 0) > self.max_deliveries:
                if self.on_poison is not None:  # first: its admission and prompt go back while it is still pending
                    self.on_poison(Entry.of(entry_id, fields), counts[entry_id])
                self.dead_letter(entry_id, (fields or {}).get(PAYLOAD, b""),
                                 f"max_deliveries: delivered {counts[entry_id]} times without being acked",
                                 resolved_deal=(fields or {}).get(DEAL, b""))
                continue
            out.append(Entry.of(entry_id, fields))
        return out

    def delivery_counts(self, entry_ids: list) -> dict:
        if not entry_ids:
            return {}
        lowest, highest = min(entry_ids, key=_id_key), max(entry_ids, key=_id_key)
        rows = self.retry("XPENDING", self.client.xpending_range, self.keys["groups"], GROUP, min=lowest, max=highest,
                          count=len(entry_ids) + 1000)
        return {row["message_id"]: row["times_delivered"] for row in rows}

    def trim(self) -> int:
        """Delete acked entries only (see the module doc); returns how many went."""
        return self.retry("XTRIM", self._trim)

    def _trim(self) -> int:
        try:
            summary = self.client.xpending(self.keys["groups"], GROUP)
        except redis.ResponseError as err:  # NOGROUP: lost with a Redis that restarted empty; read() recreates it
            if "NOGROUP" in str(err):
                return 0
            raise
        if summary["pending"]:
            floor = summary["min"]
        else:
            groups = {g["name"]: g for g in self.client.xinfo_groups(self.keys["groups"])}
            floor = groups[GROUP.encode()]["last-delivered-id"] if GROUP.encode() in groups else b"0-0"
        if floor in (b"0-0", "0-0"):
            return 0
        return self.client.xtrim(self.keys["groups"], minid=floor, approximate=False)

    def length(self) -> int:
        return self.retry("XLEN", self.client.xlen, self.keys["groups"])

    def unread(self) -> int:
        """Entries not yet delivered to any consumer of the learner's group."""
        try:
            groups = self.retry("XINFO GROUPS", self.client.xinfo_groups, self.keys["groups"])
        except redis.ResponseError:  # no stream (yet, or lost with a Redis that restarted empty)
            return 0
        for info in groups:
            if info["name"] == GROUP.encode():
                lag = info.get("lag")
                return int(lag) if lag is not None else 0
        return self.length()

    def pending_count(self) -> int:
        return self.client.xpending(self.keys["groups"], GROUP)["pending"]

    def dead_letters(self) -> list[dict]:
        return [fields for _, fields in self.client.xrange(self.keys["dead"])]


def _id_key(entry_id) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    millis, seq = text.split("-")
    return int(millis), int(seq)


def reset_job(client, job: str) -> int:
    """Delete every key of `job` (a fresh start under a namespace an older run used); returns how many went."""
    keys = job_keys(job)
    names = [keys[name] for name in ("groups", "dead", "version", "started", "leases", "meta", "duplicates",
                                     "rejections")]
    names += [keys["meta"] + ":stats", keys["meta"] + ":joins", keys["meta"] + ":sampled"]
    names += [keys[f"data_{name}"] for name in DATA_KEYS]
    removed = client.delete(*names)
    for marks in ("seen", "grant", "given"):
        batch = []
        for key in client.scan_iter(match=keys[marks] + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                removed += client.delete(*batch)
                batch = []
        if batch:
            removed += client.delete(*batch)
    return removed
