"""The learner's side of the Redis backend, with the ZmqBufferServer interface the learner loop uses.

Redis holds everything a generator on another machine needs (`asyncrl:{job}:meta`): the config hash, the run info
(model, data, MLflow run), the newest weights' control message and the done flag; generators write their join
records and statistics beside it. Groups arrive through the stream (redis_stream.py, whose docstring states the
exactly-once protocol); admission is the Lua coordinator (redis_coordinator.py). Nothing here runs a thread: `take`
reads the stream when the learner asks.
"""
import json
import logging
import time
from collections import Counter, deque

from asyncrl.buffer.codec import CodecError, decode_group
from asyncrl.buffer.redis_conn import redacted
from asyncrl.buffer.redis_stream import GroupStream

log = logging.getLogger(__name__)
NO_VERSION_LIMIT = 1 << 30


class RedisBufferServer:
    def __init__(self, client, url: str, job: str, coordinator, *, vocab_size: int, config_hash: str,
                 max_message_bytes: int, run_info: dict, reclaim_idle_s: float = 60.0, read_count: int = 64):
        self.client = client
        self.coordinator = coordinator
        self.vocab_size = vocab_size
        self.config_hash = config_hash
        self.max_message_bytes = max_message_bytes
        self.run_info = dict(run_info)
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self.read_count = read_count
        self.stream = GroupStream(client, job)
        self.keys = self.stream.keys
        self.endpoint = f"{redacted(url)} (job {job})"
        self.rejected = Counter()
        self.dropped_future = 0
        self.received = 0
        self.joins: dict[str, dict] = {}
        self._ready: deque = deque()  # (entry id, Group) read but not yet taken
        self.taken_entries: list = []  # entry ids of groups handed to the learner, not yet acked
        self._next_reclaim = 0.0

    # --- learner side -------------------------------------------------------------------------------------
    def start(self) -> "RedisBufferServer":
        self.stream.ensure_group()
        self.client.hset(self.keys["meta"], mapping={"config_hash": self.config_hash,
                                                     "run_info": json.dumps(self.run_info), "done": "0"})
        return self

    def take(self, timeout_s: float):
        """The next valid group, or None after timeout_s. Invalid ones go to the dead-letter stream."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            entries = self._reclaim_due() or self.stream.read(self.read_count, max(1, int(remaining * 1000)))
            for entry_id, payload in entries:
                self._accept(entry_id, payload)
        entry_id, group = self._ready.popleft()
        self.taken_entries.append(entry_id)
        return group

    def _reclaim_due(self) -> list:
        """Entries a dead learner consumer (a previous incarnation under another name) left pending."""
        now = time.monotonic()
        if now < self._next_reclaim:
            return []
        self._next_reclaim = now + max(self.reclaim_idle_ms / 1000 / 2, 1.0)
        return self.stream.reclaim(self.reclaim_idle_ms)

    def _accept(self, entry_id: bytes, payload: bytes) -> None:
        try:
            group = decode_group(payload, vocab_size=self.vocab_size, max_version=NO_VERSION_LIMIT,
                                 max_message_bytes=self.max_message_bytes)
        except CodecError as err:
            self.stream.dead_letter(entry_id, payload, f"{err.reason}: {err}")
            self.coordinator.give_back(1)
            self.rejected[err.reason] += 1
            log.warning("buffer: group entry %s is malformed (%s); moved to the dead-letter stream", entry_id, err)
            return
        newest = max((int(s.versions.max()) for s in group.samples if len(s.versions)), default=-1)
        if newest > self.coordinator.version:
            # sampled with weights newer than this learner has: a version lost when the learner went back to its
            # checkpoint. No policy it trains can correct for it, so it is dropped (acked) and its slot given back.
            self.stream.ack([entry_id])
            self.coordinator.give_back(1)
            self.dropped_future += 1
            return
        self.received += 1
        self.joins.setdefault(group.generator_id, {"first_group_min_version": group.min_version()})
        self._ready.append((entry_id, group))

    def ack(self, entry_ids: list) -> int:
        """Acknowledge trained groups (call only once a checkpoint covering them is written), then trim what every
        reader is done with."""
        acked = self.stream.ack(list(entry_ids))
        self.stream.trim()
        return acked

    def set_weights(self, descriptor: dict) -> None:
        self.client.hset(self.keys["meta"], "weights", json.dumps(descriptor))

    def set_done(self) -> None:
        self.client.hset(self.keys["meta"], "done", "1")

    def wait_for_generators_to_hear_done(self, timeout_s: float) -> list[str]:
        return []  # the flag stays in Redis: a generator reads it whenever it next asks

    def queued(self) -> int:
        """Groups waiting: read but not taken, plus entries no consumer has read yet (the group's lag)."""
        return len(self._ready) + self.stream.unread()

    @property
    def generator_stats(self) -> dict:
        raw = self.client.hgetall(self.keys["meta"] + ":stats")
        return {key.decode(): json.loads(value) for key, value in raw.items()}

    def live_generators(self) -> list[str]:
        return sorted(self.generator_stats)

    def close(self) -> None:
        self.client.close()
