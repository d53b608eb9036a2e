"""The prompt dealer of the Redis backend: the dataset cursor lives in Redis, so every prompt of an epoch is trained
exactly once across generators on any machine, generator crashes and learner restarts included (the zmq backend
keeps the same rules in the learner's memory, buffer/dealing.py; docs/architecture.md §3.6).

Why in Redis: with Redis the generators never talk to the learner, only to Redis (admission is a Lua script), so
the prompts must be dealt there too, and a resumed learner must find the deals its generators hold and the groups
its stream still owes it. The learner, the only one holding the data, keeps a short list of deals `ready` in Redis;
admission hands one out with each lease, in the same script. State, under the job's hash tag (`data:*`):

- `cursor` (hash): fingerprint, size, epoch, position (how far the epoch's order was dealt into `ready`), `refills`
  (a counter that makes each refill apply once), dealt, consumed, refused;
- `returned` (list of places "epoch:index"): prompts to deal again before the cursor moves;
- `ready` (list of deal ids), and for every deal not yet resolved: `place` (deal -> place), `row` (deal -> the
  row's bytes, what the generator samples);
- `holder` (deal -> generator) and `out` (sorted set, deal -> deadline ms on Redis's clock) once dealt;
- `returned_by`, `filtered` (hashes: reason -> prompts), the counters of dealer.RETURN_REASONS / CONSUME_REASONS;
- `resolved` (hash: deal -> 1): deals the learner returned or filtered while their entry was still pending, until
  that entry is acked or dead-lettered (in the same transaction), so an entry met again is skipped only when its deal
  really was resolved; an entry naming a deal never dealt (or still ready, or dealt to another generator) was added
  past DELIVER and is refused.

A prompt's life: ready -> out (admission) -> delivered (DELIVER, stream.py, removes it from `out` in the script
that adds the group: only a deal out to the producer is taken, else the group is refused there) -> consumed when
the learner acks its entry after a checkpoint (the ack and the consumption are one transaction, so a restart that
re-reads a pending entry finds its deal still valid and trains it). It goes back to `returned`, counted, when its
deadline passes undelivered (`expired`), when its holder stops reporting (`generator_gone`) or gives it back
(`unused`), when its group is rejected, stale, or in a poisoned step. The learner returns a prompt before it
dead-letters or acks the entry, and an entry met again whose deal it resolved (marked in `resolved`) is acked and
skipped, so a crash between the two never trains a prompt twice or loses one. Every script is idempotent, so the
reconnect policy (reconnect.py) may resend any of them.
"""
import logging
import time
import uuid
from typing import NamedTuple

from asyncrl.buffer.dealing import CONSUME_REASONS, RETURN_REASONS, STATE_FORMAT, DealError, PromptDealer, epoch_order
from asyncrl.buffer.redis.reconnect import direct
from asyncrl.buffer.redis.stream import GROUP, job_keys

log = logging.getLogger(__name__)
TICK_S = 0.25
"""How often `take` refills the ready list and expires deals."""
SETTLE_OUTCOMES = ("unused", "generator_gone", *CONSUME_REASONS)

_RESOLVE_BODY = """
local function resolve(deal, mode, reason)
  local place = redis.call('HGET', KEYS[4], deal)
  if not place then return false end
  redis.call('HDEL', KEYS[4], deal)
  redis.call('HDEL', KEYS[2], deal)
  redis.call('HDEL', KEYS[3], deal)
  redis.call('ZREM', KEYS[1], deal)
  if mode == 'return' then
    redis.call('RPUSH', KEYS[5], place)
    redis.call('HINCRBY', KEYS[6], reason, 1)
  else
    redis.call('HINCRBY', KEYS[8], 'consumed', 1)
    if mode == 'filter' then redis.call('HINCRBY', KEYS[7], reason, 1) end
  end
  return true
end
"""
STATE_KEYS = ("data_out", "data_holder", "data_row", "data_place", "data_returned", "data_returned_by",
              "data_filtered", "data_cursor")
"""KEYS[1..8] of the scripts below (RESOLVE's helper reads them by position)."""

RESOLVE = _RESOLVE_BODY + """
-- KEYS: STATE_KEYS, KEYS[9] started, KEYS[10] resolved; ARGV[1] mode (return | filter | consume), ARGV[2] reason,
-- then pairs of (deal id, '1' when its group held an admission lease, given back with it). A deal returned or
-- filtered is marked resolved while its entry stays pending; consume (with the entry's ack) clears the mark.
-- Returns how many were resolved.
local n = 0
for i = 3, #ARGV, 2 do
  if resolve(ARGV[i], ARGV[1], ARGV[2]) then
    n = n + 1
    if ARGV[1] ~= 'consume' then redis.call('HSET', KEYS[10], ARGV[i], '1') end
    if ARGV[i + 1] == '1' then
      local left = tonumber(redis.call('GET', KEYS[9]) or '0') - 1
      if left < 0 then left = 0 end
      redis.call('SET', KEYS[9], left)
    end
  end
  if ARGV[1] == 'consume' then redis.call('HDEL', KEYS[10], ARGV[i]) end
end
return n
"""

SETTLE = _RESOLVE_BODY + """
-- A generator hands back deals it holds: KEYS: STATE_KEYS; ARGV[1] the generator, ARGV[2] outcome, then deal ids.
-- The outcome names a metric: only the known ones are taken (a writer's own word never becomes a metric name).
local modes = {unused = 'return', generator_gone = 'return', zero_variance = 'filter', skipped = 'filter',
               empty = 'filter', no_baseline = 'filter'}
local mode = modes[ARGV[2]]
if not mode then return 0 end
local n = 0
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1] and redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    if resolve(ARGV[i], mode, ARGV[2]) then n = n + 1 end
  end
end
return n
"""

EXPIRE = _RESOLVE_BODY + """
-- Deals out past their deadline, and those held by the generators in ARGV (stopped reporting), go back.
if redis.replicate_commands then redis.replicate_commands() end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local n = 0
for _, deal in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  if resolve(deal, 'return', 'expired') then n = n + 1 end
end
if #ARGV > 0 then
  local gone = {}
  for _, gen in ipairs(ARGV) do gone[gen] = true end
  for _, deal in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local holder = redis.call('HGET', KEYS[2], deal)
    if holder and gone[holder] and resolve(deal, 'return', 'generator_gone') then n = n + 1 end
  end
end
return n
"""

REFILL = """
-- KEYS[1] cursor, KEYS[2] returned, KEYS[3] ready, KEYS[4] place, KEYS[5] row; ARGV[1] the refills counter this
-- learner read, ARGV[2] places taken from the head of `returned`, ARGV[3] epoch, ARGV[4] position after, then
-- triples (deal id, place, row). Applies once: a resend after a lost reply finds the counter moved and returns 0.
if tonumber(redis.call('HGET', KEYS[1], 'refills') or '0') ~= tonumber(ARGV[1]) then return 0 end
if tonumber(ARGV[2]) > 0 then redis.call('LTRIM', KEYS[2], tonumber(ARGV[2]), -1) end
for i = 5, #ARGV, 3 do
  redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1])
  redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 2])
  redis.call('RPUSH', KEYS[3], ARGV[i])
end
redis.call('HSET', KEYS[1], 'epoch', ARGV[3], 'position', ARGV[4], 'refills', tonumber(ARGV[1]) + 1)
return 1
"""


def settle_deals(client, keys: dict, generator_id: str, deal_ids: list, outcome: str) -> int:
    """A generator's side: deals it holds and hands back without a group (`unused` and `generator_gone` go back
    to the epoch, dealer.CONSUME_REASONS are consumed). Only deals out to it count; returns how many did."""
    if outcome not in SETTLE_OUTCOMES or not deal_ids:
        return 0
    return int(client.eval(SETTLE, len(STATE_KEYS), *[keys[name] for name in STATE_KEYS], generator_id, outcome,
                            *deal_ids))


def forget_holder(client, keys: dict, generator_id: str) -> int:
    """Every deal out to `generator_id` goes back to the epoch (`generator_gone`), with those past their deadline
    (`expired`): a generator process that joins under an id holds none of that id's deals."""
    return int(client.eval(EXPIRE, len(STATE_KEYS), *[keys[name] for name in STATE_KEYS], generator_id))


class DealState(NamedTuple):
    """A deal as Redis holds it when the learner reads an entry that names it."""
    place: tuple | None
    """(epoch, index) while unresolved; None once resolved, or for a deal never dealt."""
    holder: str | None
    """The generator it was dealt to; None while it waits in `ready` (never dealt), and once resolved."""
    out: bool
    """Dealt and not delivered: no entry added through DELIVER can answer it."""
    resolved: bool
    """The learner resolved it (returned or filtered) while its entry was pending: that entry is skipped."""


def foreign_deal(held: bool, state: DealState | None, producer: str) -> str | None:
    """Why an entry's deal (one the learner did not resolve) cannot be the entry's own, or None when it can:
    DELIVER admits an entry only under a deal out to its producer, so an entry under any other was added past it
    (`never dealt` covers one still waiting in `ready`). `held`: the learner holds the deal already, for another
    entry's group."""
    if held:
        return "already held"
    if state is not None and state.out:
        return "undelivered"
    if state is None or state.place is None or state.holder is None:
        return "never dealt"
    if state.holder != producer:
        return f"dealt to {state.holder!r}"
    return None


def place_of(text) -> tuple[int, int]:
    epoch, index = (text.decode() if isinstance(text, bytes) else text).split(":")
    return int(epoch), int(index)


class RedisDealer:
    """The learner's side: keeps `ready` filled from the cursor, expires deals, checks each group's deal when it is
    read, resolves deals as the learner gives groups back or acks them, and says when the data ran out.

    `base` is the zmq dealer built from the job's prompts (and restored from the checkpoint's cursor): its rows,
    fingerprint and order are what is dealt, and its cursor is used only when Redis has none (a fresh job, or a
    Redis that lost its data)."""

    def __init__(self, client, job: str, base: PromptDealer, ready_target: int, retry=direct, clock=time.monotonic):
        self.client = client
        self.keys = job_keys(job)
        self.base = base
        self.ready_target = max(1, ready_target)
        self.retry = retry
        self.clock = clock
        self.size, self.fingerprint, self.data_sources = base.size, base.fingerprint, base.data_sources
        self.epochs, self.timeout_s = base.epochs, base.timeout_s
        self.epoch, self.position, self.refills = 0, 0, 0
        self._order: list = []
        self._incarnation = uuid.uuid4().hex[:8]
        self._serial = 0
        self.held: dict = {}  # deal id -> place, of the groups this learner read and has not resolved
        self.skipped_resolved = 0  # entries met again whose deal was already resolved (acked, skipped)
        self._next_tick = 0.0
        self._first_holding: dict = {}  # generator -> when this learner first saw it hold a deal
        self._resolve = client.register_script(RESOLVE)
        self._expire = client.register_script(EXPIRE)
        self._refill = client.register_script(REFILL)

    def _keys(self, *names) -> list:
        return [self.keys[name] for name in names]

    # --- the cursor -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Carry on from the cursor in Redis, or write one from `base` when there is none."""
        self.retry("data cursor", self._load_or_init)
        log.info("learner: dealing %d prompts through Redis (epoch %.2f%s)", self.size,
                 self.epoch + self.position / self.size, f" of {self.epochs}" if self.epochs else "")
        self.tick(force=True)

    def _load_or_init(self) -> None:
        cursor = self.client.hgetall(self.keys["data_cursor"])
        if b"fingerprint" not in cursor:
            self._write_initial()
            cursor = self.client.hgetall(self.keys["data_cursor"])
        fingerprint = cursor[b"fingerprint"].decode()
        if fingerprint != self.fingerprint:
            raise DealError(f"the data cursor in Redis belongs to another dataset (fingerprint {fingerprint} over "
                            f"{int(cursor.get(b'size', 0))} prompts; this job has {self.fingerprint} over "
                            f"{self.size}): resume with the same data files, data.max_prompt_tokens and tokenizer, "
                            f"or start a new job (or another buffer.redis.namespace)")
        self.epoch, self.position = int(cursor[b"epoch"]), int(cursor[b"position"])
        self.refills = int(cursor.get(b"refills", 0))
        self._order = epoch_order(self.size, self.epoch, self.base.shuffle, self.base.seed)

    def _write_initial(self) -> None:
        """The cursor from `base`: epoch 0 for a fresh job, else the checkpoint's (its prompts out then are dealt
        again, as the zmq dealer does after a restart). Redis's data state is empty here, so nothing can clash."""
        snap = self.base.snapshot()
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*self._keys("data_returned", "data_ready", "data_place", "data_row", "data_holder", "data_out",
                                "data_returned_by", "data_filtered", "data_resolved"))
        pipe.hset(self.keys["data_cursor"], mapping={
            "format": STATE_FORMAT, "fingerprint": self.fingerprint, "size": self.size, "epoch": snap["epoch"],
            "position": snap["position"], "refills": 0, "dealt": snap["dealt"], "consumed": snap["consumed"],
            "refused": 0})
        if snap["returned"]:
            pipe.rpush(self.keys["data_returned"], *[f"{epoch}:{index}" for epoch, index in snap["returned"]])
        for name, counts in (("data_returned_by", snap["returned_by_reason"]),
                             ("data_filtered", snap["filtered_by_reason"])):
            if counts:
                pipe.hset(self.keys[name], mapping=counts)
        pipe.execute()

    def _cursor_done(self) -> bool:
        return self.position >= self.size and self.epochs is not None and self.epoch + 1 >= self.epochs

    def tick(self, force: bool = False, gone: list = (), last_heard: dict | None = None,
             silence_s: float = 0.0) -> None:
        """At most every TICK_S (each `take`): deals past their deadline go back, and those held by `gone`
        generators or by any not heard from for `silence_s` (`last_heard`: generator -> when its report last
        changed, on this clock; one never heard from counts from when this learner first saw it hold a deal).
        Then `ready` is filled up to ready_target, returned prompts first."""
        now = self.clock()
        if not force and now < self._next_tick:
            return
        self._next_tick = now + TICK_S
        gone = list(gone)
        if last_heard is not None and silence_s > 0:
            gone += [holder for holder in self._holders() if holder not in gone and now - last_heard.get(
                holder, self._first_holding.setdefault(holder, now)) >= silence_s]
        expired = self.retry("deal expiry", self._expire, keys=self._keys(*STATE_KEYS), args=gone)
        if expired:
            log.info("learner: %d dealt prompts went back to the epoch (past data.deal_timeout_s, or their "
                     "generator stopped reporting)", expired)
        self.retry("deal refill", self._refill_once)

    def _holders(self) -> set:
        """The generators holding deals out (dealt, not delivered)."""
        def read():
            out = self.client.zrange(self.keys["data_out"], 0, -1)
            return self.client.hmget(self.keys["data_holder"], out) if out else []
        return {holder.decode(errors="replace") for holder in self.retry("deal holders", read) if holder}

    def _refill_once(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        ready, returned = pipe.llen(self.keys["data_ready"]).llen(self.keys["data_returned"]).execute()
        want = self.ready_target - int(ready)
        if want <= 0:
            return
        heads = self.client.lrange(self.keys["data_returned"], 0, want - 1) if returned else []
        places = [place_of(head) for head in heads]
        epoch, position, order = self.epoch, self.position, self._order
        while len(places) < want:
            if position >= self.size:
                if self.epochs is not None and epoch + 1 >= self.epochs:
                    break
                epoch, position = epoch + 1, 0
                order = epoch_order(self.size, epoch, self.base.shuffle, self.base.seed)
            places.append((epoch, order[position]))
            position += 1
        if not places:
            return
        args = [self.refills, len(heads), epoch, position]
        for place in places:
            self._serial += 1
            args += [f"{self._incarnation}-{self._serial}", f"{place[0]}:{place[1]}", self.base.row_blob(place[1])]
        if self._refill(keys=self._keys("data_cursor", "data_returned", "data_ready", "data_place", "data_row"),
                        args=args):
            self.epoch, self.position, self._order, self.refills = epoch, position, order, self.refills + 1
        else:  # applied by an earlier attempt whose reply was lost, or another writer: read what Redis holds
            self._load_or_init()

    # --- groups as the learner reads them ---------------------------------------------------------------------
    def states(self, deal_ids: list) -> dict:
        """deal id -> its DealState, for the deals of a batch of entries (one round trip)."""
        ids = [deal for deal in dict.fromkeys(deal_ids) if deal]
        if not ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        places, scores, holders, marks = self.retry("deal states", pipe.hmget(self.keys["data_place"], ids).zmscore(
            self.keys["data_out"], ids).hmget(self.keys["data_holder"], ids).hmget(self.keys["data_resolved"], ids)
            .execute)
        return {deal: DealState(None if place is None else place_of(place),
                                None if holder is None else holder.decode(errors="replace"), score is not None,
                                mark is not None)
                for deal, place, score, holder, mark in zip(ids, places, scores, holders, marks)}

    def prompt_id(self, place: tuple) -> str:
        return self.base.prompt_id_at(place[1])

    def prompt_digest(self, place: tuple) -> bytes:
        return self.base.prompt_digest_at(place[1])

    def hold(self, deal_id: str, place: tuple) -> None:
        """The learner read a valid group for this deal: it is the learner's until it acks or gives it back."""
        self.held[deal_id] = place

    def resolve(self, mode: str, reason: str, deals: list) -> int:
        """Resolve `deals` ((deal id, its group held a lease) pairs): `return` them to the epoch counted under
        `reason`, `filter` (consumed untrained) or `consume` (trained). Leases are given back with them, once."""
        deals = [(deal, leased) for deal, leased in deals if deal]
        for deal, _ in deals:
            self.held.pop(deal, None)
        if not deals:
            return 0
        args = [mode, reason] + [value for deal, leased in deals for value in (deal, "1" if leased else "0")]
        return int(self.retry("deal resolution", self._resolve, keys=self._keys(*STATE_KEYS, "started",
                                                                                 "data_resolved"), args=args))

    def give_back(self, deal_id: str, leased: bool, reason: str) -> int:
        """A taken group the learner will not train: filtered (dealer.CONSUME_REASONS) its prompt stays consumed,
        else it goes back to the epoch."""
        mode = "filter" if reason in CONSUME_REASONS else "return"
        return self.resolve(mode, reason if reason in (*RETURN_REASONS, *CONSUME_REASONS) else "rejected",
                            [(deal_id, leased)])

    def ack_and_consume(self, entry_ids: list, deal_ids: list) -> int:
        """Ack trained entries and consume their deals in one transaction (see the module doc)."""
        for deal in deal_ids:
            self.held.pop(deal, None)

        def once():  # EVAL, not EVALSHA: inside MULTI a NOSCRIPT (Redis restarted) would fail alone (stream.py)
            pipe = self.client.pipeline(transaction=True)
            if entry_ids:
                pipe.xack(self.keys["groups"], GROUP, *entry_ids)
            if deal_ids:
                pipe.eval(RESOLVE, len(STATE_KEYS) + 2, *self._keys(*STATE_KEYS, "started", "data_resolved"),
                          "consume", "",
                          *[value for deal in deal_ids for value in (deal, "0")])
            replies = pipe.execute()
            return replies[0] if entry_ids else 0

        if not entry_ids and not deal_ids:
            return 0
        return int(self.retry("ack and consume", once))

    # --- the learner's questions ------------------------------------------------------------------------------
    def exhausted(self) -> bool:
        """The last epoch was dealt and every prompt not consumed is held by this learner (read, in training or in
        the batch at hand): nothing more will come."""
        if not self._cursor_done():
            return False
        pipe = self.client.pipeline(transaction=False)
        returned, ready, unresolved = self.retry("data state", pipe.llen(self.keys["data_returned"]).llen(
            self.keys["data_ready"]).hlen(self.keys["data_place"]).execute)
        return not returned and not ready and int(unresolved) <= len(self.held)

    def snapshot(self) -> dict:
        """The cursor in dealer.PromptDealer's format, for the checkpoint: used only if Redis comes back without
        its data. Ready prompts count as returned (dealt first), those out to generators (not held by this
        learner) as out, dealt again after such a restart."""
        pipe = self.client.pipeline(transaction=False)
        cursor, returned, ready, places, returned_by, filtered = self.retry("data snapshot", pipe.hgetall(
            self.keys["data_cursor"]).lrange(self.keys["data_returned"], 0, -1).lrange(self.keys["data_ready"], 0, -1)
            .hgetall(self.keys["data_place"]).hgetall(self.keys["data_returned_by"])
            .hgetall(self.keys["data_filtered"]).execute)
        ready = [deal for deal in ready if deal in places]
        unsettled = set(ready) | {deal.encode() for deal in self.held}
        return {"format": STATE_FORMAT, "fingerprint": self.fingerprint, "size": self.size, "epoch": self.epoch,
                "position": self.position,
                "returned": [list(place_of(place)) for place in [*returned, *(places[deal] for deal in ready)]],
                "out": [list(place_of(place)) for deal, place in places.items() if deal not in unsettled],
                "dealt": int(cursor.get(b"dealt", 0)), "consumed": int(cursor.get(b"consumed", 0)),
                "returned_by_reason": _counts(returned_by), "filtered_by_reason": _counts(filtered)}

    def refused(self) -> int:
        """Groups refused for their deal, by DELIVER or by the learner (data/refused)."""
        return int(self.retry("refusals", self.client.hget, self.keys["data_cursor"], "refused") or 0)

    def metrics(self) -> dict:
        pipe = self.client.pipeline(transaction=False)
        cursor, returned_by, filtered, out = self.retry("data metrics", pipe.hgetall(self.keys["data_cursor"])
                                                        .hgetall(self.keys["data_returned_by"])
                                                        .hgetall(self.keys["data_filtered"])
                                                        .zcard(self.keys["data_out"]).execute)
        metrics = {"data/epoch": self.epoch + self.position / self.size, "data/dealt": float(cursor.get(b"dealt", 0)),
                   "data/consumed": float(cursor.get(b"consumed", 0)), "data/out": float(out),
                   "data/refused": float(cursor.get(b"refused", 0)),
                   "data/skipped_resolved": float(self.skipped_resolved)}
        for name, counts in (("returned", _counts(returned_by)), ("filtered", _counts(filtered))):
            for reason, count in counts.items():
                metrics[f"data/{name}/{reason}"] = float(count)
        return metrics


def _counts(raw: dict) -> dict:
    return {key.decode(): int(value) for key, value in raw.items()}
