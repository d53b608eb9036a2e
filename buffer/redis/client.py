"""The generator's side of the Redis backend (`interface.GeneratorBuffer`, as the zmq client), so the rollout loop
is the same for both backends.

hello reads the run metadata the learner left in Redis (it answers "not ready" until a learner has started); admit
runs the Lua admission and keeps the granted leases; group adds the group to the stream and releases one lease in
the same script; stats and the join record go to hashes beside the metadata; bye releases unused leases. Redis
calls are synchronous and short, so they run in a worker thread. When the learner deals the prompts (the hello's
run info says `deals`), admission hands out a ready deal with each lease in the same script, a group carries its
deal to DELIVER (refused there unless the deal is out to this generator), and released or abandoned deals go back
through `dealing.settle_deals` (buffer/redis/dealing.py).

A Redis that stops answering (restarted, network cut) is retried for buffer.redis.reconnect_s (reconnect.py):
each request is idempotent, so it is resent whole. Its token is fixed before the first try: admission's lease
prefix, so a resent admit is answered with the same grant; a group's lease, taken once, so a resent group neither
loses its lease nor takes another. Past the patience the request raises LearnerUnavailable naming the server, and
the generator exits as it would with a dead zmq learner.
"""
import asyncio
import json
import time

import uuid

import redis

import msgpack

from asyncrl.buffer.dealing import check_deal
from asyncrl.buffer.eval_rounds import decode_eval_task, evals_wanted
from asyncrl.buffer.interface import (AdmitReply, GeneratorRefused, HelloReply, LearnerUnavailable, RunInfo, SendReply,
                                     Status, decode_weights, too_large_reply)
from asyncrl.buffer.plausibility import check_admit
from asyncrl.buffer.redis.conn import redacted
from asyncrl.buffer.redis.coordinator import RedisCoordinator
from asyncrl.buffer.redis.dealing import forget_holder, settle_deals
from asyncrl.buffer.redis.eval_bridge import answer_eval, take_evals
from asyncrl.buffer.redis.produce import DeliveryBatcher, produce_batch
from asyncrl.buffer.redis.reconnect import RedisUnavailable, direct
from asyncrl.buffer.redis.rejection_news import TAKE as TAKE_NEWS, heard
from asyncrl.buffer.redis.sampled import push_sampled
from asyncrl.buffer.redis.stream import REFUSED, GroupStream
from asyncrl.weightsync.announcement import WeightsAnnouncement


class NotRegistered(RuntimeError):
    """No learner has written this job's metadata to Redis (not started yet, or Redis restarted empty)."""


class RedisBufferClient:
    def __init__(self, client, url: str, job: str, generator_id: str, lead: int, groups_per_step: int,
                 lease_s: float, retry=direct, max_message_bytes: int = 0):
        self.client = client
        self.max_message_bytes = max_message_bytes  # the job's limit; 0: not checked here
        self.endpoint = redacted(url)
        self.generator_id = generator_id
        self.retry = retry
        self.stream = GroupStream(client, job, producer=generator_id)  # direct: the whole request is retried
        self.keys = self.stream.keys
        self.coordinator = RedisCoordinator(client, job, lead, groups_per_step, lease_s)
        self.batcher = DeliveryBatcher(self._send_batch)
        self.leases: list[str] = []
        self.deal_ms = 0  # > 0 when the learner deals the prompts (data.deal_timeout_s, from the run info)
        self.reports = 0
        self.evaluates = False  # the learner runs evaluation rounds (the run info says `evals`)
        self.deals_held: dict = {}  # deal ids dealt to this generator and not yet delivered or handed back
        self._weights: tuple[str, WeightsAnnouncement | None] = ("", None)  # (weights_id, announcement): read
        # again only when the id changes

    # --- interface.GeneratorBuffer ------------------------------------------------------------------------------
    async def hello(self, config_hash: str, timeout_s: float | None = None) -> HelloReply:
        reply = await self._request("hello", timeout_s=timeout_s, config_hash=config_hash)
        if not reply.get("ok"):
            raise GeneratorRefused(reply.get("error", "refused"), reply.get("shared_config"))
        return HelloReply(**_status(reply), run_info=reply["run_info"])

    async def admit(self, want: int = 1, version: int | None = None) -> AdmitReply:
        reply = await self._request("admit", want=want, version=version)
        return AdmitReply(**_status(reply), granted=reply["granted"],
                          deals=[check_deal(deal) for deal in reply.get("deals", ())],
                          evals=[decode_eval_task(_unpack(task)) for task in reply.get("evals", ())])

    async def send(self, group_id: str, payload: bytes, deal: str = "") -> SendReply:
        if self.max_message_bytes and len(payload) > self.max_message_bytes:
            return too_large_reply(len(payload), self.max_message_bytes, self._weights[1])
        reply = await self._deliver(group_id, payload, deal)
        return SendReply(**_status(reply), accepted=reply["accepted"], reason=reply.get("reason", ""),
                         error=reply.get("error", ""))

    async def release(self, count: int = 1, deals: list | None = None, outcome: str = "unused",
                      rewards: list | None = None) -> Status:
        return Status(**_status(await self._request("release", count=count, deals=list(deals or ()),
                                                    outcome=outcome, rewards=rewards)))

    async def eval_done(self, deal_id: str, rewards: list | None, lengths: list | None,
                        texts: list | None = None) -> Status:
        return Status(**_status(await self._request("eval_done", deal=deal_id, rewards=rewards, lengths=lengths,
                                                    texts=texts)))

    async def report(self, metrics: dict, timeout_s: float | None = None) -> Status:
        return Status(**_status(await self._request("stats", timeout_s=timeout_s, metrics=metrics)))

    async def bye(self, timeout_s: float | None = None) -> None:
        await self._request("bye", timeout_s=timeout_s)

    async def _request(self, op: str, timeout_s: float | None = None, **fields) -> dict:
        """One control operation (hello, admit, release, stats, bye) in a worker thread, retried through an outage."""
        token = ""
        if op == "admit":
            token = f"{self.generator_id}:{uuid.uuid4().hex[:12]}"
        retry = self.retry.within(timeout_s) if timeout_s else self.retry
        try:
            return await asyncio.to_thread(retry, op, self._handle, op, fields, token)
        except NotRegistered as err:
            raise LearnerUnavailable(f"Redis at {self.endpoint}: {err}") from None
        except (redis.ConnectionError, redis.TimeoutError, RedisUnavailable) as err:
            raise LearnerUnavailable(f"Redis at {self.endpoint} did not answer {op!r}: {err}") from None

    async def _deliver(self, group_id: str, body: bytes, deal: str = "") -> dict:
        """A group goes out with the other in-flight deliveries: one round trip for all (a duplicate adds nothing).
        Its lease is taken once, so a resend neither loses it nor takes another. A group whose deal is no longer
        out to this generator (past data.deal_timeout_s: dealt again) is refused in the same script."""
        if not group_id:
            return {"ok": False, "accepted": False, "weights": None, "done": False,
                    "error": "a group request needs its group_id (idempotence key)"}
        lease = self.leases.pop(0) if self.leases else ""
        try:
            reply, _, result = await self.batcher.deliver((group_id, body, lease, deal))
        except (redis.ConnectionError, redis.TimeoutError, RedisUnavailable) as err:
            raise LearnerUnavailable(f"Redis at {self.endpoint} did not take group {group_id}: {err}") from None
        self.deals_held.pop(deal, None)
        if result == REFUSED:
            return {**reply, "accepted": False, "reason": "unknown_deal",
                    "error": f"deal {deal!r} is not out to {self.generator_id!r} (past data.deal_timeout_s, its prompt "
                             f"was dealt again; or never dealt) [unknown_deal]"}
        # the group is in the stream even if the metadata is not (Redis restarted empty): the learner reads it
        return {**reply, "accepted": True}

    def _send_batch(self, deliveries: list) -> tuple:
        """(the reply fields, read once for the whole batch; version; each delivery's result)."""
        raw_meta, version, results = self.retry("group delivery", produce_batch, self.client, self.stream, deliveries,
                                               META_FIELDS)
        meta = meta_of(raw_meta)
        weights = self.retry("weights", self._weights_for, meta["weights_id"])
        return reply_fields(meta, weights), version, results

    def _handle(self, op: str, fields: dict, token: str) -> dict:
        """One control request, in one round trip: the run metadata, the version, this generator's rejection news
        (rejection_news.py), and a count in `meta:heard` (generator -> requests made: the learner tells a live
        generator by that count changing, from its first request on; stats come later, and only now and then);
        then the operation."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.keys["meta"], *META_FIELDS).get(self.keys["version"])
        pipe.eval(TAKE_NEWS, 1, self.keys["rejections"], self.generator_id)
        raw_meta, version, news, _ = pipe.hincrby(self.keys["meta"] + ":heard", self.generator_id, 1).execute()
        meta = meta_of(raw_meta)
        reply = self._op(op, meta, self._reply(meta, op), int(version or 0), fields, token)
        return {**reply, "rejected": heard(news)}

    def _reply(self, meta: dict, op: str) -> dict:
        """The fields every reply carries, from the run metadata the learner keeps in Redis."""
        if meta["config_hash"] is None:
            if op == "hello":  # the caller waits for the learner to start, saying so
                raise NotRegistered("no learner has registered this job yet")
            # mid-run, the metadata can only be missing because Redis restarted empty: the learner rewrites it as
            # soon as it reconnects, so this is waited out like the outage itself
            raise redis.ConnectionError("the job's metadata is gone from Redis; waiting for the learner to rewrite it")
        return reply_fields(meta, self._weights_for(meta["weights_id"]))

    def _weights_for(self, weights_id: str | None) -> WeightsAnnouncement | None:
        """The announcement `weights_id` names, read from Redis only when it is not the one already held: it
        lists every tensor (17 KB of JSON for a 0.5B model, over 1 MB for a large MoE), and reading and parsing it
        with every request cost more than the request. A learner that writes no id (older) is read every time."""
        held_id, held = self._weights
        if weights_id is not None and weights_id == held_id:
            return held
        fresh_id, raw = self.client.hmget(self.keys["meta"], "weights_id", "weights")
        descriptor = decode_weights(json.loads(raw or "null"), self.endpoint)
        if fresh_id is not None:
            self._weights = (fresh_id.decode(), descriptor)
        return descriptor

    def _op(self, op: str, meta: dict, reply: dict, version: int, fields: dict, token: str) -> dict:
        if op == "hello":
            if fields.get("config_hash") != meta["config_hash"]:
                try:
                    shared = json.loads(self.client.hget(self.keys["meta"], "shared_config") or "null")
                except ValueError:  # only the refusal's detail is lost
                    shared = None
                return {**reply, "ok": False, "shared_config": shared, "error": (
                    f"config mismatch: generator {self.generator_id!r} has shared-config hash "
                    f"{fields.get('config_hash')!r}, the learner has {meta['config_hash']!r}; start both with the "
                    f"same recipe and shared overrides")}
            self.client.hsetnx(self.keys["meta"] + ":joins", self.generator_id, json.dumps(
                {"hello_version": version, "at": time.time()}))
            run_info = RunInfo.from_wire(json.loads(self.client.hget(self.keys["meta"], "run_info") or "null"),
                                         self.endpoint)
            self.evaluates = run_info.evals
            if run_info.deals:
                self.deal_ms = max(1, int(run_info.deal_timeout_s * 1000))
                # a process that just joined holds nothing: deals out under this id (a predecessor killed with -9)
                # go back to the epoch now rather than after data.deal_timeout_s
                forget_holder(self.client, self.keys, self.generator_id)
            return {**reply, "run_info": run_info}
        if op == "admit":
            problem = check_admit(fields.get("want", 1), fields.get("version"))
            if problem is not None:  # the scripts refuse it too (and count it): a generator runs them itself
                return {**reply, "ok": False, "granted": 0, "error": f"{problem} [malformed]"}
            granted, deals, evals, want = [], [], [], fields.get("want", 1)
            if not reply["done"] and self.evaluates and isinstance(fields.get("version"), int) and want:
                evals = take_evals(self.client, self.keys, self.generator_id, fields["version"], evals_wanted(want),
                                   token, self.coordinator.lease_ms + 3_600_000)
                want -= len(evals)
            if not reply["done"]:
                granted, _, deals = self.coordinator.admit_dealt(
                    self.generator_id, want, self.deal_ms, request_id=token)
            self.leases.extend(granted)
            self.deals_held.update(dict.fromkeys(deal_id for deal_id, _ in deals))
            return {**reply, "granted": len(granted), "deals": deals, "evals": evals}
        if op == "release":  # leases are interchangeable; a resend after a lost reply removes nothing twice
            leases = self.leases[:max(0, int(fields.get("count", 1)))]
            self.coordinator.release(leases)
            del self.leases[:len(leases)]
            deals = [deal for deal in fields.get("deals", ()) if deal in self.deals_held]
            settle_deals(self.client, self.keys, self.generator_id, deals, fields.get("outcome", "unused"))
            for deal in deals:
                self.deals_held.pop(deal, None)
            if fields.get("rewards") is not None and leases:  # the learner's reward of what was sampled
                push_sampled(self.client, self.keys, self.generator_id, fields["rewards"])
            return reply
        if op == "eval_done":
            answer_eval(self.client, self.keys, self.generator_id, str(fields.get("deal")), fields.get("rewards"),
                        fields.get("lengths"), fields.get("texts"))
            return reply
        if op == "stats":
            # numbered, so that every report differs: the learner tells a live generator from a silent one by
            # its report changing (no clocks compared), and an idle generator's figures repeat
            self.reports += 1
            self.client.hset(self.keys["meta"] + ":stats", self.generator_id, json.dumps(
                {**fields.get("metrics", {}), "generator/reports": float(self.reports)}))
            return reply
        if op == "bye":
            self.coordinator.release(self.leases)
            self.leases = []
            settle_deals(self.client, self.keys, self.generator_id, list(self.deals_held), "generator_gone")
            self.deals_held = {}
            self.client.hdel(self.keys["meta"] + ":stats", self.generator_id)
            self.client.hdel(self.keys["meta"] + ":heard", self.generator_id)
            return reply
        return {**reply, "ok": False, "error": f"unknown op {op!r}"}

    def close(self) -> None:
        self.client.close()


META_FIELDS = ("config_hash", "done", "weights_id")
"""The run metadata read with every request: small fields only. The weights' announcement is read apart, when
its id changes (`RedisBufferClient._weights_for`)."""


def meta_of(values: list) -> dict:
    """META_FIELDS -> str, or None for a field Redis does not hold, from an HMGET reply."""
    return {name: None if value is None else value.decode() for name, value in zip(META_FIELDS, values)}


def reply_fields(meta: dict, weights: WeightsAnnouncement | None) -> dict:
    """The fields every reply carries (as the zmq learner's), from the run metadata the learner keeps in Redis."""
    return {"ok": True, "weights": weights, "done": meta.get("done") == "1"}


def _unpack(task: bytes):
    """An evaluation task as EVAL_TAKE returns it; anything that is not msgpack is refused by decode_eval_task."""
    try:
        return msgpack.unpackb(task, raw=False, strict_map_key=False)
    except Exception:
        return None


def _status(reply: dict) -> dict:
    """The `interface.Status` fields of a reply dict (`rejected`: the learner's news of this generator's groups it
    dead-lettered, read with each control request; a group reply carries none)."""
    return {"weights": reply.get("weights"), "done": bool(reply.get("done")), "rejected": reply.get("rejected")}
