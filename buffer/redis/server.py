"""The learner's side of the Redis backend (`interface.LearnerBuffer`, as the zmq server).

Redis holds everything a generator on another machine needs (`asyncrl:{job}:meta`): the config hash, the run info
(model, data, MLflow run), the newest weights' announcement and the done flag; generators write their join
records and statistics beside it. Groups arrive through the stream (stream.py, whose docstring states the
exactly-once protocol); admission is the Lua coordinator (coordinator.py). Nothing here runs a thread: `take`
reads the stream when the learner asks.

Through a Redis restart (reconnect.py) the server keeps two sets so no group is trained twice: `held`, the
entries it has read and not yet acked (skipped when the pending list is re-read after a reconnect, and kept from
XAUTOCLAIM by touching them), and the most recent acked ones (skipped and acked again, should an ack have been lost
with the server's last writes).

When the learner deals the prompts (`dealer`, dealing.py), every entry answers a deal that DELIVER checked as out
to its producer; the learner checks the group against it (the same deal in its meta, the dealt prompt), holds it
while training, and consumes it with the ack, or returns its prompt to the epoch when it gives the group back.
"""
import json
import logging
import time
import uuid
from collections import OrderedDict, deque

import redis

from asyncrl.buffer.codec import CodecError, decode_group
from asyncrl.buffer.dealing import answer_of, answer_problem
from asyncrl.buffer.fleet_stats import fleet_metrics
from asyncrl.buffer.interface import RunInfo
from asyncrl.buffer.plausibility import JobLimits, check_stats
from asyncrl.telemetry.rejections import RejectionLog
from asyncrl.buffer.redis.conn import redacted
from asyncrl.buffer.redis.dealing import foreign_deal
from asyncrl.buffer.redis.reconnect import direct
from asyncrl.buffer.redis.rejection_news import TELL, tell_args
from asyncrl.buffer.redis.eval_bridge import RedisEvalBridge
from asyncrl.buffer.redis.sampled import drain_sampled
from asyncrl.buffer.sampled import SampledRewards, SampledSoFar
from asyncrl.buffer.redis.stream import GroupStream, job_keys
from asyncrl.weightsync.announcement import WeightsAnnouncement

log = logging.getLogger(__name__)
TRIM_EVERY_S = 1.0
ACKED_MEMORY = 200_000  # acked entry ids remembered (about 20 MB); far more than one checkpoint interval's groups
EVAL_TICK_S = 0.25
"""How often `take` moves evaluation results and tasks between Redis and the learner's rounds."""
SAMPLED_TICK_S = 0.5
"""How often `take` drains the rewards of the groups generators filtered (buffer/redis/sampled.py)."""
RECENT_TAKES = 4096  # taken groups whose lease is remembered for give_back (collect_batch gives back right away)


class RedisBufferServer:
    def __init__(self, client, url: str, job: str, coordinator, *, vocab_size: int, config_hash: str,
                 max_message_bytes: int, run_info: RunInfo, reclaim_idle_s: float = 60.0, read_count: int = 64,
                 retry=direct, limits: JobLimits | None = None, shared_config: dict | None = None,
                 stats_ttl_s: float = 120.0, dealer=None, evals=None):
        self.client = client
        self.dealer = dealer  # dealing.RedisDealer, or None: the generators walk their own copy of the data
        self.retry = retry
        self._next_eval_tick = 0.0
        self.coordinator = coordinator
        self.vocab_size = vocab_size
        self.config_hash = config_hash
        self.limits = limits
        self.shared_config = shared_config or {}  # in the metadata: a refused generator names the keys that differ
        self.stats_ttl_s = stats_ttl_s
        self._next_hearing = 0.0
        self._stats_seen: dict = {}  # generator -> (its last raw report, when it last changed, its parse or None)
        self._heard_seen: dict = {}  # generator -> (its request count, when it last changed)
        self.max_message_bytes = max_message_bytes
        self.run_info = run_info
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self.read_count = read_count
        self.stream = GroupStream(client, job, retry=retry, on_poison=self._poisoned)
        self.keys = self.stream.keys
        self.endpoint = f"{redacted(url)} (job {job})"
        self._rejections = RejectionLog(log, "group entry")
        self._tell = client.register_script(TELL)  # the producer hears of it with its next request
        self.evals = None if evals is None else RedisEvalBridge(client, job_keys(job), evals, self._rejections,
                                                                retry=retry)
        self.dropped_future = 0
        self._script_refusals_seen = 0  # admission requests the scripts refused, as last logged
        self._held_admission: OrderedDict = OrderedDict()  # group id -> (entry id, held a lease, deal), recent takes
        self.received = 0
        self.sampled = SampledRewards()  # the rewards of every group taken or filtered (buffer/sampled.py)
        self._next_sampled_tick = 0.0
        self.joins: dict[str, dict] = {}
        self._ready: deque = deque()  # (entry id, Group) read but not yet taken
        self.taken_entries: list = []  # (entry id, deal id) of groups handed to the learner, not yet acked
        self.held: set = set()  # entry ids read (ready or taken) and not yet acked
        self._acked: OrderedDict = OrderedDict()  # recently acked entry ids, oldest first
        self.redelivered = 0  # entries delivered again that this learner already held or acked (skipped)
        self._weights: dict | None = None  # the announcement, as it travels (WeightsAnnouncement.to_wire)
        self._weights_id = ""  # fresh per set_weights: generators re-read the announcement only when it changes
        self._done = False
        self._next_reclaim = 0.0
        self._next_trim = 0.0
        retry.on_reconnect(self._after_reconnect)

    # --- learner side -------------------------------------------------------------------------------------
    def start(self) -> None:
        self.stream.ensure_group()
        self._write_meta()
        if self.dealer is not None:
            self.dealer.start()
        if self.evals is not None:
            self.evals.start()

    def _write_meta(self, retry=None) -> None:
        """Everything a generator needs, in one hash; idempotent, so it is simply rewritten after a reconnect."""
        (retry or self.retry)("run metadata", self.client.hset, self.keys["meta"], mapping={
            "config_hash": self.config_hash, "run_info": json.dumps(self.run_info.to_wire()),
            "shared_config": json.dumps(self.shared_config),
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
            if self.dealer is not None or self.evals is not None:
                self._hear_generators()
            if self.dealer is not None:
                self.dealer.tick(last_heard={gen: seen[1] for gen, seen in self._stats_seen.items()},
                                 silence_s=self.stats_ttl_s)
            if time.monotonic() >= self._next_sampled_tick:
                self._drain_sampled()
            if self.evals is not None and time.monotonic() >= self._next_eval_tick:
                self.serve_evals()
            try:
                entries = self._reclaim_due() or self.stream.read(self.read_count, max(1, int(remaining * 1000)),
                                                                  held=frozenset(self.held))
            except redis.ResponseError as err:
                if "NOGROUP" not in str(err):
                    raise
                # Redis restarted without its data while we were idle (redis-py redials silently, so only this
                # tells): rebuild and keep reading what generators send from now on.
                self.retry("rebuilding the lost stream", self._after_reconnect)
                continue
            version = self._version() if entries else 0
            states = self.dealer.states([e.deal.decode(errors="replace") for e in entries]) if self.dealer else {}
            for entry in entries:
                if entry.entry_id in self.held:  # re-read after a reconnect: already ours
                    self.redelivered += 1
                elif entry.entry_id in self._acked:  # its ack was lost with Redis's last writes: ack again, skip
                    self.redelivered += 1
                    self.stream.ack([entry.entry_id])
                else:
                    group = self._decode(entry, version)
                    if group is not None and self._dealt(entry, group, states):
                        self._accept(entry, group)
        entry_id, group = self._ready.popleft()
        self.taken_entries.append((entry_id, group.meta.get("deal", "") if self.dealer is not None else ""))
        self.sampled.add(group.episode_rewards())
        return group

    def serve_evals(self) -> None:
        """Evaluation results in, prompts out, silent generators' prompts back (eval_bridge.py): every EVAL_TICK_S
        from `take`, and at the end of the job, when nobody calls take, from the learner's wait for the last
        rounds."""
        if self.evals is None:
            return
        self._next_eval_tick = time.monotonic() + EVAL_TICK_S
        now = time.monotonic()
        self.evals.tick(gone=[gen for gen, (_, changed, _) in self._stats_seen.items()
                              if now - changed >= self.stats_ttl_s])

    def _drain_sampled(self) -> None:
        self._next_sampled_tick = time.monotonic() + SAMPLED_TICK_S
        self.retry("filtered groups' rewards", drain_sampled, self.client, self.keys, self.sampled, self._rejections,
                   self.limits.group_size if self.limits else None)

    def take_sampled(self) -> dict:
        self._drain_sampled()
        return self.sampled.take_window()

    def sampled_so_far(self) -> SampledSoFar:
        if time.monotonic() >= self._next_sampled_tick:
            self._drain_sampled()
        return self.sampled.seen()

    def _hear_generators(self) -> None:
        """Read the generators' reports often enough (a quarter of stats_ttl_s, at most once a second) that the
        dealer never takes a live generator for a silent one while the learner waits for a batch."""
        now = time.monotonic()
        if now >= self._next_hearing:
            self._next_hearing = now + max(1.0, self.stats_ttl_s / 4)
            self.generator_stats  # noqa: B018 - refreshes _stats_seen
            self._heard()  # seen early, so a count that stops changing later reads as silence

    def _dealt(self, entry, group, states: dict) -> bool:
        """Without a dealer, True. With one: the group answers the deal its entry carries (DELIVER checked it was
        out to the producer) for the prompt dealt. An entry whose deal this learner resolved while it was pending
        (its group given back or refused before a restart) is acked and skipped; anything else wrong is refused
        (`_refuse_deal`), its prompt going back to the epoch when the deal was this entry's."""
        if self.dealer is None:
            return True
        deal, producer = entry.deal.decode(errors="replace"), entry.producer.decode(errors="replace")
        state = states.get(deal)
        if not deal:
            self._refuse_deal(entry, f"group {group.group_id}: the learner deals the prompts and this group answers "
                                     f"no deal")
            return False
        if state is not None and state.resolved and state.place is None:
            self.stream.ack([entry.entry_id], resolved_deals=[deal])
            self.dealer.skipped_resolved += 1
            return False
        problem = foreign_deal(deal in self.dealer.held, state, producer)
        if problem is not None:  # not this entry's deal: refused, and the deal left to its own entry
            self._refuse_deal(entry, f"group {group.group_id}: deal {deal!r} is {problem}", give_back=False)
            return False
        problem = answer_problem(deal, answer_of(group, compare_tokens=not (self.limits and self.limits.episodes)),
                                 self.dealer.prompt_id(state.place), self.dealer.prompt_digest(state.place))
        if problem is None:
            self.dealer.hold(deal, state.place)
            return True
        self._refuse_deal(entry, f"group {group.group_id}: {problem}")
        return False

    def _refuse_deal(self, entry, problem: str, give_back: bool = True) -> None:
        """An entry that answers no deal of its producer's: dead-lettered as unknown_deal and counted once, in the
        data cursor's `refused` beside DELIVER's refusals (`rejected` reports that count). `give_back`: the deal
        is this entry's, so its prompt (and lease) go back to the epoch first."""
        if give_back:
            self._give_back_entry(entry)
        error = f"{problem} [unknown_deal]"
        self.stream.dead_letter(entry.entry_id, entry.payload, f"unknown_deal: {error}", refused_deal=True,
                                resolved_deal=entry.deal if give_back else b"")
        self._rejections.reject("unknown_deal", entry.producer.decode(errors="replace") or "an unnamed writer", error)
        self._tell_producer(entry, error)

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

    def _decode(self, entry, version: int):
        """The entry's group, or None after dropping it: one that is malformed, implausible for this job, or not
        its producer's goes to the dead-letter stream; one sampled with weights newer than this learner has is acked
        and counted (a version lost when the learner went back to its checkpoint: no policy it trains can correct
        for it). Either way its admission is given back if it held one (keyed on the entry, so a retried give-back
        counts once; keyed on the bytes, a generator that sent the same garbage twice would leak one admission each
        time)."""
        try:
            group = decode_group(entry.payload, vocab_size=self.vocab_size, max_version=version,
                                 max_message_bytes=self.max_message_bytes, limits=self.limits)
        except CodecError as err:
            self._give_back_entry(entry, "stale" if err.reason == "future_version" else "rejected")
            if err.reason == "future_version":  # the codec says this last: everything else is valid
                self.stream.ack([entry.entry_id], resolved_deals=[entry.deal] if entry.deal else [])
                self.dropped_future += 1
            else:
                self._dead_letter(entry, err.reason, str(err))
            return None
        if group.generator_id.encode() != entry.producer:  # one identity: a writer speaks only for itself
            self._give_back_entry(entry)
            self._dead_letter(entry, "generator_id", f"generator_id: {group.generator_id!r} added by "
                                                     f"{entry.producer.decode(errors='replace')!r} [generator_id]")
            return None
        return group

    def _poisoned(self, entry, deliveries: int) -> None:
        """An entry no learner got through (each read of it ended in a crash) goes to the dead-letter stream."""
        self._give_back_entry(entry, "poisoned_step")
        self._rejections.reject("max_deliveries", entry.producer.decode(errors="replace") or "an unnamed writer",
                                f"entry {entry.entry_id.decode()} was delivered {deliveries} times and never acked")

    def _give_back_entry(self, entry, reason: str = "rejected") -> None:
        """Before the entry goes: a group that held an admission (it released a lease when it was added) returns
        it; one sent without asking never took one. Its dealt prompt goes back to the epoch, with the lease in
        one script (a resend returns nothing twice)."""
        if self.dealer is not None and entry.deal:
            self.dealer.resolve("return", reason, [(entry.deal.decode(errors="replace"), bool(entry.lease))])
        elif entry.lease:
            self.coordinator.give_back(1, token=entry.entry_id.decode())

    def _dead_letter(self, entry, reason: str, error: str) -> None:
        """After `_give_back_entry`: the entry goes, and its deal's resolved mark with it."""
        self.stream.dead_letter(entry.entry_id, entry.payload, f"{reason}: {error}", resolved_deal=entry.deal)
        self._rejections.reject(reason, entry.producer.decode(errors="replace") or "an unnamed writer", error)
        self._tell_producer(entry, error)

    def _tell_producer(self, entry, error: str) -> None:
        """The generator that added a rejected entry hears of it in its next request's reply
        (buffer/redis/rejection_news.py), as a zmq generator does."""
        if entry.producer:
            self._tell_generator(entry.producer.decode(errors="replace"), error)

    def _tell_generator(self, generator_id: str, error: str) -> None:
        self.retry("rejection news", self._tell, keys=[self.keys["rejections"]], args=tell_args(generator_id, error))

    @property
    def rejected(self) -> dict:
        """reason -> entries dead-lettered so far (and generator stats reports refused). `unknown_deal` is the data
        cursor's `refused`, in Redis: DELIVER refuses most groups outside their deal with no learner involved, the
        learner the rest (`_refuse_deal`), and each is counted there once, so it equals data/refused (both over the
        job's life, across learner restarts)."""
        counts = self._rejections.snapshot()
        if self.dealer is not None:
            counts.pop("unknown_deal", None)
            refused = self.dealer.refused()
            if refused:
                counts["unknown_deal"] = refused
        return counts

    def _accept(self, entry, group) -> None:
        self.received += 1
        self.held.add(entry.entry_id)
        self._held_admission[group.group_id] = (entry.entry_id, bool(entry.lease), entry.deal.decode(errors="replace"))
        while len(self._held_admission) > RECENT_TAKES:
            self._held_admission.popitem(last=False)
        if group.generator_id not in self.joins:  # only its first group counts; skip the scan for the rest
            self.joins[group.generator_id] = {"first_group_min_version": group.min_version()}
        self._ready.append((entry.entry_id, group))

    def ack(self, entry_ids: list, deal_ids: list = ()) -> int:
        """Acknowledge trained groups (call only once a checkpoint covering them is written), consuming their deals
        in the same transaction, then trim what every reader is done with."""
        entry_ids = [e if isinstance(e, bytes) else e.encode() for e in entry_ids]
        if self.dealer is not None:
            acked = self.dealer.ack_and_consume(entry_ids, [deal for deal in deal_ids if deal])
        else:
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

    def give_back(self, group, reason: str = "stale") -> None:
        """A taken group the learner will not train: its admission frees capacity if it held one (idempotent on its
        group id). Its dealt prompt goes back to the epoch, or stays consumed when `reason` filtered it."""
        _, leased, deal = self._held_admission.pop(group.group_id, (None, False, ""))
        if self.dealer is not None and deal:
            self.dealer.give_back(deal, leased, reason)
        elif leased:
            self.coordinator.give_back(1, token=group.group_id)

    def quarantine(self, groups: list, reason: str, detail: str = "poisoned a step") -> None:
        for group in groups:
            entry_id, leased, deal = self._held_admission.pop(group.group_id, (None, False, ""))
            if self.dealer is not None and deal:  # before the entry goes (dealing.py)
                self.dealer.resolve("return", reason, [(deal, leased)])
            elif leased:
                self.coordinator.give_back(1, token=group.group_id)
            self._tell_generator(group.generator_id, f"group {group.group_id}: {detail} [{reason}]")
            if entry_id is None:  # taken too long ago to be known: it is acked with its step's checkpoint
                self._rejections.reject(reason, group.generator_id, f"group {group.group_id}: {detail}")
                continue
            self.stream.dead_letter(entry_id, self.stream.payload_of(entry_id), f"{reason}: {detail}",
                                    resolved_deal=deal.encode())
            self.held.discard(entry_id)
            self._rejections.reject(reason, group.generator_id, f"group {group.group_id} (entry "
                                                                 f"{entry_id.decode()}): {detail}")

    def announce_weights(self, message: WeightsAnnouncement) -> None:
        self._weights, self._weights_id = message.to_wire(), uuid.uuid4().hex[:16]
        self._write_meta()

    def set_version(self, version: int) -> None:
        self.coordinator.set_version(version)

    def take_receipts(self) -> list[str]:
        """The stream entries of the groups taken since the last call, each with its deal ("<entry>|<deal>"):
        acked, and their deals consumed, once a checkpoint covers them."""
        receipts = [f"{entry.decode()}|{deal}" if deal else entry.decode() for entry, deal in self.taken_entries]
        self.taken_entries.clear()
        return receipts

    def on_checkpoint(self, receipts: list[str]) -> None:
        entries, deals = [], []
        for receipt in receipts:
            entry, _, deal = receipt.partition("|")
            entries.append(entry)
            deals.append(deal)
        self.ack(entries, deals)

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
        if self.dealer is not None:
            out.update(self.dealer.metrics())
        if self.evals is not None:
            out.update(self.evals.metrics())
        stats = self.generator_stats  # read first: a bad report it refuses is counted below
        rejected = dict(self.rejected)
        for reason, count in self._script_refusals().items():
            rejected[reason] = rejected.get(reason, 0) + count
        for reason, count in rejected.items():
            out[f"buffer/rejected/{reason}"] = float(count)
        out.update(fleet_metrics(list(stats.values())))
        return out

    def _script_refusals(self) -> dict:
        """reason -> requests the admission scripts refused (coordinator.py ADMIT, eval_bridge.py EVAL_TAKE: a
        generator runs them itself, so they count in Redis); a warning when the count grows."""
        raw = self.retry("refusals", self.client.hgetall, self.keys["refused"])
        counts = {key.decode(errors="replace"): int(value) for key, value in raw.items()}
        if sum(counts.values()) > self._script_refusals_seen:
            log.warning("buffer: Redis refused %d malformed admission requests so far (%s)", sum(counts.values()),
                        counts)
            self._script_refusals_seen = sum(counts.values())
        return counts

    @property
    def duplicates(self) -> int:
        """Resent deliveries dropped before any reader saw them (stream.py, step 1), counted in Redis."""
        return self.stream.duplicates()

    def queued(self) -> int:
        """Groups waiting: read but not taken, plus entries no consumer has read yet (the group's lag)."""
        return len(self._ready) + self.stream.unread()

    @property
    def generator_stats(self) -> dict:
        """generator -> its last report, for the generators that reported within stats_ttl_s (a report that stops
        changing is a generator that stopped: no clocks are compared, so machines need not agree on the time).
        Reports are data: one that is not a map of finite numbers is refused and counted, once."""
        raw = self.retry("generator stats", self.client.hgetall, self.keys["meta"] + ":stats")
        now, out = time.monotonic(), {}
        for key, value in raw.items():
            gen = key.decode(errors="replace")
            seen = self._stats_seen.get(gen)
            if seen is None or seen[0] != value:
                seen = (value, now, self._parse_stats(gen, value))
                self._stats_seen[gen] = seen
            if seen[2] is not None and now - seen[1] < self.stats_ttl_s:
                out[gen] = seen[2]
        return out

    def _parse_stats(self, gen: str, value: bytes) -> dict | None:
        try:
            metrics = json.loads(value)
        except ValueError as err:
            problem = f"not JSON: {err}"
        else:
            problem = check_stats(metrics)
        if problem is None:
            return metrics
        self._rejections.reject("stats", gen, problem)
        return None

    def live_generators(self) -> list[str]:
        """Generators that made any request (their `meta:heard` count changed) or reported stats within
        stats_ttl_s, as the zmq learner judges by any request: a generator that has not reported stats yet is
        alive all the same (the end-of-job evaluation wait used to end at once for want of one)."""
        now = time.monotonic()
        return sorted(set(self.generator_stats) | {gen for gen, changed in self._heard().items()
                                                   if now - changed < self.stats_ttl_s})

    def _heard(self) -> dict:
        """generator -> when (this learner's monotonic clock) its request count last changed; no clocks compared."""
        raw = self.retry("generator requests", self.client.hgetall, self.keys["meta"] + ":heard")
        now, heard = time.monotonic(), {}
        for key, count in raw.items():
            gen = key.decode(errors="replace")
            seen = self._heard_seen.get(gen)
            if seen is None or seen[0] != count:
                seen = (count, now)
            heard[gen] = seen
        self._heard_seen = heard  # a generator that said bye is forgotten
        return {gen: changed for gen, (_, changed) in heard.items()}

    def close(self) -> None:
        self.client.close()
