"""The generator's side of the Redis backend, with BufferClient's `request(op, ...)` interface, so the rollout loop
is the same for both backends.

hello reads the run metadata the learner left in Redis (it answers "not ready" until a learner has started); admit
runs the Lua admission and keeps the granted leases; group adds the group to the stream and releases one lease in
the same script; stats and the join record go to hashes beside the metadata; bye releases unused leases. Redis
calls are synchronous and short, so they run in a worker thread; a Redis that does not answer raises
LearnerUnavailable naming it, and the generator retries or exits as it would with the zmq learner.
"""
import asyncio
import json
import time

import redis

from asyncrl.buffer.redis_conn import redacted
from asyncrl.buffer.redis_coordinator import RedisCoordinator
from asyncrl.buffer.redis_stream import GroupStream
from asyncrl.buffer.zmq_client import LearnerUnavailable


class RedisBufferClient:
    def __init__(self, client, url: str, job: str, generator_id: str, max_staleness: int, groups_per_step: int,
                 lease_s: float):
        self.client = client
        self.endpoint = redacted(url)
        self.generator_id = generator_id
        self.stream = GroupStream(client, job)
        self.keys = self.stream.keys
        self.coordinator = RedisCoordinator(client, job, max_staleness, groups_per_step, lease_s)
        self.leases: list[str] = []

    async def request(self, op: str, body: bytes | None = None, timeout_s: float | None = None, **fields) -> dict:
        try:
            return await asyncio.to_thread(self._handle, op, body, fields)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise LearnerUnavailable(f"Redis at {self.endpoint} did not answer {op!r}: {err}") from None

    def _handle(self, op: str, body, fields: dict) -> dict:
        meta = {key.decode(): value.decode() for key, value in self.client.hgetall(self.keys["meta"]).items()}
        if "config_hash" not in meta:  # no learner has started this job yet
            raise redis.ConnectionError("no learner has registered this job in Redis yet")
        version = self.coordinator.version
        reply = {"ok": True, "version": version, "weights": json.loads(meta.get("weights") or "{}"),
                 "done": meta.get("done") == "1"}
        if op == "hello":
            if fields.get("config_hash") != meta["config_hash"]:
                return {**reply, "ok": False, "error": (
                    f"config mismatch: generator {self.generator_id!r} has shared-config hash "
                    f"{fields.get('config_hash')!r}, the learner has {meta['config_hash']!r}; start both with the "
                    f"same recipe and shared overrides")}
            self.client.hsetnx(self.keys["meta"] + ":joins", self.generator_id, json.dumps(
                {"hello_version": version, "at": time.time()}))
            return {**reply, "run_info": json.loads(meta["run_info"])}
        if op == "admit":
            granted = []
            if not reply["done"]:
                granted, reply["version"] = self.coordinator.try_admit(self.generator_id, fields.get("want", 1))
            self.leases.extend(granted)
            return {**reply, "granted": len(granted)}
        if op == "group":
            if not fields.get("group_id"):
                return {**reply, "ok": False, "accepted": False, "retry": False,
                        "error": "a group request needs its group_id (idempotence key)"}
            lease = self.leases.pop(0) if self.leases else ""
            self.stream.produce(fields["group_id"], body, lease_id=lease)  # a duplicate adds nothing: accepted
            return {**reply, "accepted": True}
        if op == "stats":
            self.client.hset(self.keys["meta"] + ":stats", self.generator_id, json.dumps(fields.get("metrics", {})))
            return reply
        if op == "bye":
            self.coordinator.release(self.leases)
            self.leases = []
            self.client.hdel(self.keys["meta"] + ":stats", self.generator_id)
            return reply
        return {**reply, "ok": False, "error": f"unknown op {op!r}"}

    def close(self) -> None:
        self.client.close()
