"""The learner's side of the Redis backend (`interface.LearnerBuffer`, as the zmq server).

Redis holds everything a generator on another machine needs (`asyncrl:{job}:meta`): the config hash, the run info
(model, data, MLflow run), the newest weights' control message and the done flag; generators write their join
records and statistics beside it. Groups arrive through the stream (stream.py, whose docstring states the
exactly-once protocol); admission is the Lua coordinator (coordinator.py). Nothing here runs a thread: `take`
reads the stream when the learner asks.

Through a Redis restart (reconnect.py) the server keeps two sets so no group is trained twice: `held`, the
entries it has read and not yet acked (skipped when the pending list is re-read after a reconnect, and kept from
XAUTOCLAIM by touching them), and the most recent acked ones (skipped and acked again, should an ack have been lost
with the server's last writes).
"""
import json
import logging
import time
import uuid
from collections import Counter, OrderedDict, deque

import redis

from asyncrl.buffer.codec import CodecError, decode_group
from asyncrl.buffer.redis.conn import redacted
from asyncrl.buffer.redis.reconnect import direct
from asyncrl.buffer.redis.stream import GroupStream

log = logging.getLogger(__name__)
NO_VERSION_LIMIT = 1 << 30
TRIM_EVERY_S = 1.0
ACKED_MEMORY = 200_000  # acked entry ids remembered (about 20 MB); far more than one checkpoint interval's groups


class RedisBufferServer:
    def __init__(self, client, url: str, job: str, coordinator, *, vocab_size: int, config_hash: str,
                 max_message_bytes: int, run_info: dict, reclaim_idle_s: float = 60.0, read_count: int = 64,
                 retry=direct):
        self.client = client
        self.retry = retry
        self.coordinator = coordinator
        self.vocab_size = vocab_size
        self.config_hash = config_hash
        self.max_message_bytes = max_message_bytes
        self.run_info = dict(run_info)
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self.read_count = read_count
        self.stream = GroupStream(client, job, retry=retry)
        self.keys = self.stream.keys
        self.endpoint = f"{redacted(url)} (job {job})"
        self.rejected = Counter()
        self.dropped_future = 0
        self.received = 0
        self.joins: dict[str, dict] = {}
        self._ready: deque = deque()  # (entry id, Group) read but not yet taken
        self.taken_entries: list = []  # entry ids of groups handed to the learner, not yet acked
        self.held: set = set()  # entry ids read (ready or taken) and not yet acked
        self._acked: OrderedDict = OrderedDict()  # recently acked entry ids, oldest first
        self.redelivered = 0  # entries delivered again that this learner already held or acked (skipped)
        self._weights: dict = {}
        self._weights_id = ""  # fresh per set_weights: generators re-read the control message only when it changes
        self._done = False
        self._next_reclaim = 0.0
        self._next_trim = 0.0
        retry.on_reconnect(self._after_reconnect)

    # --- learner side -------------------------------------------------------------------------------------
    def start(self) -> None:
        self.stream.ensure_group()
        self._write_meta()

    def _write_meta(self, retry=None) -> None:
        """Everything a generator needs, in one hash; idempotent, so it is simply rewritten after a reconnect."""
        (retry or self.retry)("run metadata", self.client.hset, self.keys["meta"], mapping={
            "config_hash": self.config_hash, "run_info": json.dumps(self.run_info),
            "weights": json.dumps(self._weights), "weights_id": self._weights_id, "done": "1" if self._done else "0"})

    def _after_reconnect(self) -> None:
        """Redis answered again: what it may have lost is restored, and entries it may have delivered to us in a
        reply we never received are re-read from our pending list. Runs inside the retry loop, so it calls Redis
        directly (a connection error here just means Redis is not back yet)."""
        if self.stream.create_group():
            log.error("Redis came back without the buffer stream (restarted without AOF?): the groups queued in it "
                      "are lost; recreated it")
        self._write_meta(retry=direct)
        self.coordinator.reassert_version()
        self.stream.restart_pending()

    def take(self, timeout_s: float):
        """The next valid group, or None after timeout_s. Invalid ones go to the dead-letter stream."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                entries = self._reclaim_due() or self.stream.read(self.read_count, max(1, int(remaining * 1000)))
            except redis.ResponseError as err:
                if "NOGROUP" not in str(err):
                    raise
                # Redis restarted without its data while we were idle (redis-py redials silently, so only this
                # tells): rebuild and keep reading what generators send from now on.
                self.retry("rebuilding the lost stream", self._after_reconnect)
                continue
            version = self._version() if entries else 0
            for entry_id, payload, _ in entries:
                if entry_id in self.held:  # re-read after a reconnect: already ours
                    self.redelivered += 1
                elif entry_id in self._acked:  # its ack was lost with Redis's last writes: ack again, skip
                    self.redelivered += 1
                    self.stream.ack([entry_id])
                else:
                    group = self._decode(entry_id, payload, version)
                    if group is not None:
                        self._accept(entry_id, group)
        entry_id, group = self._ready.popleft()
        self.taken_entries.append(entry_id)
        return group

    def _version(self) -> int:
        """The learner's version: the one it set itself (the learner is the version's only writer, so no round
        trip), else Redis's (one read per batch, not per group)."""
        published = self.coordinator.published
        return self.coordinator.version if published is None else published

    def _reclaim_due(self) -> list:
        """Entries a dead learner consumer (a previous incarnation under another name) left pending."""
        now = time.monotonic()
        if now < self._next_reclaim:
            return []
        self._next_reclaim = now + max(self.reclaim_idle_ms / 1000 / 2, 1.0)
        self.stream.touch(list(self.held))  # ours, however long training and the checkpoint take
        return self.stream.reclaim(self.reclaim_idle_ms, held=frozenset(self.held))

    def _decode(self, entry_id: bytes, payload: bytes, version: int):
        """The entry's group, or None after dropping it: a malformed one goes to the dead-letter stream; one
        sampled with weights newer than this learner has is acked. Either way its admission is given back (keyed on
        the entry, so a retried give-back counts once; keyed on the bytes, a generator that sent the same garbage
        twice would leak one admission each time).

        Newer weights are a version lost when the learner went back to its checkpoint; no policy it trains can
        correct for them. The codec checks versions against `version` in the pass it makes anyway, and only a
        group it refuses for that is decoded again without the limit, to tell "newer" from malformed: a
        separate pass over every group's versions cost about 10 us per group."""
        try:
            return decode_group(payload, vocab_size=self.vocab_size, max_version=version,
                                max_message_bytes=self.max_message_bytes)
        except CodecError as err:
            self.coordinator.give_back(1, token=entry_id.decode())  # before the entry goes: a resend counts once
            if err.reason == "bad_version" and self._valid_without_version_limit(payload):
                self.stream.ack([entry_id])
                self.dropped_future += 1
                return None
            self.stream.dead_letter(entry_id, payload, f"{err.reason}: {err}")
            self.rejected[err.reason] += 1
            log.warning("buffer: group entry %s is malformed (%s); moved to the dead-letter stream", entry_id, err)
            return None

    def _valid_without_version_limit(self, payload: bytes) -> bool:
        try:
            decode_group(payload, vocab_size=self.vocab_size, max_version=NO_VERSION_LIMIT,
                         max_message_bytes=self.max_message_bytes)
        except CodecError:
            return False
        return True

    def _accept(self, entry_id: bytes, group) -> None:
        self.received += 1
        self.held.add(entry_id)
        if group.generator_id not in self.joins:  # only its first group counts; skip the scan for the rest
            self.joins[group.generator_id] = {"first_group_min_version": group.min_version()}
        self._ready.append((entry_id, group))

    def ack(self, entry_ids: list) -> int:
        """Acknowledge trained groups (call only once a checkpoint covering them is written), then trim what every
        reader is done with."""
        entry_ids = [e if isinstance(e, bytes) else e.encode() for e in entry_ids]
        acked = self.stream.ack(entry_ids)
        for entry_id in entry_ids:
            self.held.discard(entry_id)
            self._acked[entry_id] = None
        while len(self._acked) > ACKED_MEMORY:
            self._acked.popitem(last=False)
        now = time.monotonic()
        if now >= self._next_trim:  # at most once a second: three round trips, and memory grows slowly
            self._next_trim = now + TRIM_EVERY_S
            self.stream.trim()
        return acked

    def give_back(self, group) -> None:
        """A taken group the learner will not train: its admission frees capacity (idempotent on its group id)."""
        self.coordinator.give_back(1, token=group.group_id)

    def announce_weights(self, message: dict) -> None:
        self._weights, self._weights_id = dict(message), uuid.uuid4().hex[:16]
        self._write_meta()

    def set_version(self, version: int) -> None:
        self.coordinator.set_version(version)

    def take_receipts(self) -> list[str]:
        """The stream entries of the groups taken since the last call: acked once a checkpoint covers them."""
        receipts = [entry.decode() for entry in self.taken_entries]
        self.taken_entries.clear()
        return receipts

    def on_checkpoint(self, receipts: list[str]) -> None:
        self.ack(receipts)

    def finish(self, grace_s: float) -> list[str]:
        """The done flag stays in Redis (buffer/done.py): a generator reads it whenever it next asks; nobody waits."""
        self._done = True
        self._write_meta()
        return []

    def generators(self) -> dict:
        return {gen: dict(record) for gen, record in self.joins.items()}

    def metrics(self) -> dict:
        out = {"buffer/size": float(self.queued()), "buffer/received": float(self.received),
               "buffer/dropped/future_version": float(self.dropped_future),
               "buffer/redis/outages": float(self.retry.outages),  # lost and reconnected
               "buffer/redis/redelivered": float(self.redelivered),  # re-read after a reconnect, skipped
               "buffer/redis/duplicates": float(self.duplicates)}  # resent deliveries dropped on arrival
        for reason, count in self.rejected.items():
            out[f"buffer/rejected/{reason}"] = float(count)
        rates = [stats.get("perf/generator/tokens_per_s", 0.0) for stats in self.generator_stats.values()]
        out["perf/generator/tokens_per_s"] = float(sum(rate for rate in rates if isinstance(rate, (int, float))))
        return out

    @property
    def duplicates(self) -> int:
        """Resent deliveries dropped before any reader saw them (stream.py, step 1), counted in Redis."""
        return self.stream.duplicates()

    def queued(self) -> int:
        """Groups waiting: read but not taken, plus entries no consumer has read yet (the group's lag)."""
        return len(self._ready) + self.stream.unread()

    @property
    def generator_stats(self) -> dict:
        raw = self.retry("generator stats", self.client.hgetall, self.keys["meta"] + ":stats")
        return {key.decode(): json.loads(value) for key, value in raw.items()}

    def live_generators(self) -> list[str]:
        return sorted(self.generator_stats)

    def close(self) -> None:
        self.client.close()
