"""The admission rule of docs/architecture.md §4 held in Redis, so generators on any machine share it (the zmq
backend keeps the same rule in `staleness.Coordinator`, in the learner's memory).

State, under the job's hash tag: `version` (the learner's published version), `started` (admitted groups not given
back), `leases` (a sorted set: one member per admitted group not yet delivered, scored by its expiry in ms).
Every admission is one Lua script, so the read-check-increment cannot interleave with another generator's:
1. leases past their expiry are removed and given back (`started` -= their count): a generator killed with -9
   never holds capacity for longer than the lease (AReaL issue #1396: a fleet hung at zero capacity);
2. capacity = (L + version + 1) · groups_per_step − started, never below 0 (L: the admission lead, η by default);
3. up to `want` leases are granted, named `<prefix>:<i>`, and the count is remembered under `grant:<prefix>` until the
   leases expire, so a request resent after its reply was lost (a Redis restart) is answered the same and never
   counted twice; `started` would otherwise leak capacity that no lease could ever give back.
Delivering a group releases its lease in the same transaction that adds it to the stream (redis_stream.RELEASE). A
group delivered after its lease expired is counted as started again there, so `started` stays exact.
"""
import time
import uuid

from asyncrl.buffer.plausibility import MAX_ADMIT_WANT
from asyncrl.buffer.redis.reconnect import direct
from asyncrl.buffer.redis.stream import job_keys

ADMIT = """
-- KEYS[1] version, KEYS[2] started, KEYS[3] leases, KEYS[4] this request's grant record, KEYS[5] the refusals
-- counted (reason -> count); when dealing (dealing.py): KEYS[6] the ready deals, KEYS[7] the deals out, KEYS[8]
-- their holders, KEYS[9] their rows, KEYS[10] this request's deals, KEYS[11] the data cursor
-- ARGV[1] admission lead (eta by default), ARGV[2] groups_per_step, ARGV[3] want, ARGV[4] now_ms, ARGV[5] lease_ms,
-- ARGV[6] lease prefix; when dealing: ARGV[7] data.deal_timeout_s in ms, ARGV[8] the generator
-- Returns {granted, version, leases expired, then each deal's id and row when dealing}; an error reply, counted
-- under 'malformed', for a want that is not an integer in [0, MAX_ADMIT_WANT] (a generator calls this script
-- itself, so this is where a negative want, which would take capacity away from `started`, is refused).
local want = tonumber(ARGV[3])
if not want or want ~= math.floor(want) or want < 0 or want > MAX_ADMIT_WANT then
  redis.call('HINCRBY', KEYS[5], 'malformed', 1)
  return redis.error_reply('malformed admit: want ' .. tostring(ARGV[3]) .. ' is not an integer in [0, ' ..
                           MAX_ADMIT_WANT .. '] [malformed]')
end
local dealing = #KEYS >= 11
local function dealt(out)
  for _, deal in ipairs(redis.call('LRANGE', KEYS[10], 0, -1)) do
    table.insert(out, deal)
    table.insert(out, redis.call('HGET', KEYS[9], deal) or '')
  end
  return out
end
local prior = redis.call('GET', KEYS[4])
if prior then
  local out = {tonumber(prior), tonumber(redis.call('GET', KEYS[1]) or '0'), 0}
  if dealing then return dealt(out) end
  return out
end
local now = tonumber(ARGV[4])
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local left = tonumber(redis.call('GET', KEYS[2]) or '0') - #expired
  if left < 0 then left = 0 end
  redis.call('SET', KEYS[2], left)
end
local version = tonumber(redis.call('GET', KEYS[1]) or '0')
local started = tonumber(redis.call('GET', KEYS[2]) or '0')
local cap = (tonumber(ARGV[1]) + version + 1) * tonumber(ARGV[2]) - started
if cap < 0 then cap = 0 end
local granted = math.min(want, cap)
if dealing then granted = math.min(granted, redis.call('LLEN', KEYS[6])) end
for i = 1, granted do
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), ARGV[6] .. ':' .. i)
end
redis.call('INCRBY', KEYS[2], granted)
redis.call('SET', KEYS[4], granted, 'PX', tonumber(ARGV[5]) + 3600000)  -- outlives any resend
if not dealing then return {granted, version, #expired} end
-- deadlines on Redis's clock, which the learner's expiry reads too: machines need not agree on the time
local time = redis.call('TIME')
local deadline = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + tonumber(ARGV[7])
for i = 1, granted do
  local deal = redis.call('LPOP', KEYS[6])
  redis.call('ZADD', KEYS[7], deadline, deal)
  redis.call('HSET', KEYS[8], deal, ARGV[8])
  redis.call('RPUSH', KEYS[10], deal)
end
if granted > 0 then
  redis.call('PEXPIRE', KEYS[10], tonumber(ARGV[5]) + 3600000)
  redis.call('HINCRBY', KEYS[11], 'dealt', granted)
end
return dealt({granted, version, #expired})
""".replace("MAX_ADMIT_WANT", str(MAX_ADMIT_WANT))

GIVE_BACK = """
-- KEYS[1] started, KEYS[2] (optional) this give-back's record; ARGV[1] count, ARGV[2] record ttl (s)
if KEYS[2] and not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[2]) then
  return tonumber(redis.call('GET', KEYS[1]) or '0')
end
local left = tonumber(redis.call('GET', KEYS[1]) or '0') - tonumber(ARGV[1])
if left < 0 then left = 0 end
redis.call('SET', KEYS[1], left)
return left
"""

SET_VERSION = """
-- KEYS[1] version; ARGV[1] version; ARGV[2] '1' to allow going back (a learner resumed from a checkpoint)
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local wanted = tonumber(ARGV[1])
if wanted > current or ARGV[2] == '1' then redis.call('SET', KEYS[1], wanted) return wanted end
return current
"""


class RedisCoordinator:
    """Admission, leases and the version, for one job, through one Redis client."""

    def __init__(self, client, job: str, lead: int, groups_per_step: int, lease_s: float = 120.0,
                 retry=direct):
        self.client = client
        self.retry = retry
        self.keys = job_keys(job)
        self.lead = lead  # η, or buffer.admission_lead (BufferConfig.lead_steps)
        self.groups_per_step = groups_per_step
        self.lease_ms = int(lease_s * 1000)
        self._admit = client.register_script(ADMIT)
        self._give_back = client.register_script(GIVE_BACK)
        self._set_version = client.register_script(SET_VERSION)
        self.published = None
        """The version this process last set (the learner's), re-asserted if Redis comes back without it."""

    def try_admit(self, generator_id: str, want: int = 1, now_ms: int | None = None,
                  request_id: str = "") -> tuple[list[str], int]:
        """(lease ids granted, the version now); each lease admits one group until it is delivered or expires.
        A resend with the same `request_id` (after a lost reply) gets the same leases and counts nothing twice."""
        leases, version, _ = self.admit_dealt(generator_id, want, 0, now_ms, request_id)
        return leases, version

    def admit_dealt(self, generator_id: str, want: int, deal_ms: int, now_ms: int | None = None,
                    request_id: str = "") -> tuple[list[str], int, list]:
        """try_admit, and with `deal_ms` > 0 (the learner deals the prompts: dealing.py) each grant comes with a
        ready deal, out to `generator_id` for `deal_ms`: (lease ids, version, [[deal id, row bytes], ...]). Never
        more grants than deals are ready. A resend gets the same leases and the same deals."""
        prefix = request_id or f"{generator_id}:{uuid.uuid4().hex[:12]}"
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        keys = [self.keys["version"], self.keys["started"], self.keys["leases"], self.keys["grant"] + prefix,
                self.keys["refused"]]
        args = [self.lead, self.groups_per_step, want, now_ms, self.lease_ms, prefix]
        if deal_ms > 0:
            keys += [self.keys["data_ready"], self.keys["data_out"], self.keys["data_holder"], self.keys["data_row"],
                     self.keys["grant"] + prefix + ":deals", self.keys["data_cursor"]]
            args += [int(deal_ms), generator_id]
        granted, version, _, *flat = self.retry("admission", self._admit, keys=keys, args=args)
        deals = [[deal.decode(), row] for deal, row in zip(flat[::2], flat[1::2])]
        return [f"{prefix}:{i}" for i in range(1, int(granted) + 1)], int(version), deals

    def give_back(self, count: int = 1, token: str = "") -> int:
        """Admitted groups that will never be trained (stale, rejected, dead-lettered) free their capacity. A
        `token` (the group or entry id) makes it idempotent: resent after a lost reply, it gives back nothing more."""
        keys = [self.keys["started"]] + ([self.keys["given"] + token] if token else [])
        return int(self.retry("give-back", self._give_back, keys=keys, args=[count, 7 * 24 * 3600]))

    def release(self, lease_ids: list) -> int:
        """A generator gives up leases it will not deliver (shutting down): their capacity returns at once."""
        if not lease_ids:
            return 0
        removed = self.retry("lease release", self.client.zrem, self.keys["leases"], *lease_ids)
        if removed:  # a resend after a lost reply removes nothing, so gives back nothing twice
            self.give_back(removed)
        return int(removed)

    def set_version(self, version: int, allow_backwards: bool = False) -> int:
        """Publish `version` (never lower, unless a learner resumed from an older checkpoint says so)."""
        self.published = int(version)
        return int(self.retry("version", self._set_version, keys=[self.keys["version"]],
                              args=[version, "1" if allow_backwards else "0"]))

    def reassert_version(self) -> None:
        """After a reconnect: a Redis that lost recent writes may hold an older version; put ours back."""
        if self.published is not None:
            self._set_version(keys=[self.keys["version"]], args=[self.published, "0"])

    @property
    def version(self) -> int:
        return int(self.retry("version", self.client.get, self.keys["version"]) or 0)

    @property
    def started(self) -> int:
        return int(self.retry("started", self.client.get, self.keys["started"]) or 0)

    def leases(self) -> int:
        return int(self.retry("leases", self.client.zcard, self.keys["leases"]))
