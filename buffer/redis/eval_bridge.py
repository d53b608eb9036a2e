"""Evaluation rounds on the Redis backend: the learner's `EvalRounds` (buffer/eval_rounds.py) dealt through Redis.

Why a bridge rather than a second implementation: the rounds' rules (pinned versions, checks on each result,
abandoning a late round, the metrics) stay in one place, the learner's memory, as with zmq. Only the transport
differs: with Redis the generators never talk to the learner, so the learner deals each open round's prompts into
Redis, and a generator takes them in its admit request, as the zmq reply would carry them. State, under the job's
hash tag (`eval:*`):

- `ready` (sorted set: deal id scored by its round's version) and `task` (deal id -> the task as msgpack,
  [deal id, version, row, n, temperature, max_tokens]): prompts no generator holds;
- `holder` (deal id -> generator): taken by EVAL_TAKE, which hands a generator only rounds at or after the version
  its engine holds, at most `eval_rounds.evals_wanted(want)`, and remembers them with the request so a resend gets
  the same ones;
- `results` (list of msgpack [deal id, rewards, lengths, texts]): pushed by EVAL_DONE only for a deal held by its
  sender (texts, the completions as text, may be nil);
- `engines` (generator -> the version its engine holds, from its last EVAL_TAKE): which rounds the fleet can still
  serve (EvalRounds.unservable), as the zmq learner reads it from each admit request.

On each `take` the learner drains `results` into `EvalRounds.result` (which checks them: a generator is not
trusted), gives back the deals of generators that fell silent, removes the prompts of abandoned rounds, and deals
what the rounds have left to deal (their own given-back prompts included). Every result is untrusted bytes: one
that does not decode is counted under `eval/refused` and its prompt dealt again.
"""
import logging

import msgpack

from asyncrl.buffer.eval_rounds import EVALS_PER_REQUEST, EvalRounds
from asyncrl.buffer.redis.reconnect import direct
from asyncrl.telemetry.rejections import RejectionLog

log = logging.getLogger(__name__)
LEARNER = "redis"
"""The holder the learner's EvalRounds knows every Redis deal by (Redis records the real one)."""
DRAIN = 256
"""Most results read per tick."""

EVAL_TAKE = """
-- KEYS[1] ready, KEYS[2] task, KEYS[3] holder, KEYS[4] this request's record, KEYS[5] the refusals counted (reason
-- -> count), KEYS[6] engines (generator -> the version its engine holds); ARGV[1] generator, ARGV[2] the version its engine holds, ARGV[3] most to take, ARGV[4] record ttl
-- (ms). Returns the tasks taken; an error reply, counted under 'malformed', for a version that is not an integer
-- >= 0 (v-7 would take the v0 round) or a most outside [1, EVALS_PER_REQUEST] (no generator takes a whole round).
local holds, most = tonumber(ARGV[2]), tonumber(ARGV[3])
if not holds or holds ~= math.floor(holds) or holds < 0 or not most or most ~= math.floor(most) or most < 1
   or most > EVALS_PER_REQUEST then
  redis.call('HINCRBY', KEYS[5], 'malformed', 1)
  return redis.error_reply('malformed admit: version ' .. tostring(ARGV[2]) .. ' must be an integer >= 0 and most ' ..
                           tostring(ARGV[3]) .. ' an integer in [1, EVALS_PER_REQUEST] [malformed]')
end
redis.call('HSET', KEYS[6], ARGV[1], holds)
local taken = redis.call('LRANGE', KEYS[4], 0, -1)
if #taken == 0 and redis.call('EXISTS', KEYS[4]) == 0 then
  taken = redis.call('ZRANGEBYSCORE', KEYS[1], holds, '+inf', 'LIMIT', 0, most)
  for _, deal in ipairs(taken) do
    redis.call('ZREM', KEYS[1], deal)
    redis.call('HSET', KEYS[3], deal, ARGV[1])
    redis.call('RPUSH', KEYS[4], deal)
  end
  if #taken == 0 then redis.call('RPUSH', KEYS[4], '') end
  redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[4]))
end
local out = {}
for _, deal in ipairs(taken) do
  local task = redis.call('HGET', KEYS[2], deal)
  if task then table.insert(out, task) end
end
return out
""".replace("EVALS_PER_REQUEST", str(EVALS_PER_REQUEST))

EVAL_DONE = """
-- KEYS[1] holder, KEYS[2] results; ARGV[1] generator, ARGV[2] deal id, ARGV[3] the result (msgpack). Only the
-- generator holding the deal may answer it, once.
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[3])
return 1
"""


def eval_keys(keys: dict) -> dict:
    prefix = keys["meta"][:-len("meta")] + "eval:"
    return {name: prefix + name for name in ("ready", "task", "holder", "results", "engines")}


def take_evals(client, keys: dict, generator_id: str, holder_version: int, most: int, request_id: str,
               record_ms: int) -> list:
    """The generator's side: up to `most` evaluation tasks of rounds at or after `holder_version` (the packed
    tasks; eval_rounds.decode_eval_task reads each after msgpack)."""
    ekeys = eval_keys(keys)
    return client.eval(EVAL_TAKE, 6, ekeys["ready"], ekeys["task"], ekeys["holder"], keys["grant"] + request_id +
                       ":evals", keys["refused"], ekeys["engines"], generator_id, holder_version, most,
                       int(record_ms))


def answer_eval(client, keys: dict, generator_id: str, deal_id: str, rewards, lengths, texts=None) -> bool:
    """The generator's side: a task's rewards, lengths and completion texts (None, None gives it back). False when
    the deal is not held by `generator_id` (abandoned, or given back as its holder fell silent)."""
    ekeys = eval_keys(keys)
    return bool(client.eval(EVAL_DONE, 2, ekeys["holder"], ekeys["results"], generator_id, deal_id,
                            msgpack.packb([deal_id, rewards, lengths, texts], use_bin_type=True)))


class RedisEvalBridge:
    def __init__(self, client, keys: dict, evals: EvalRounds, rejections: RejectionLog, retry=direct):
        self.client = client
        self.rejections = rejections  # the server's: a refused result counts as buffer/rejected/eval_result, as with zmq
        self.keys = eval_keys(keys)
        self.evals = evals
        self.retry = retry
        self.dealt: dict = {}  # deal id -> version, of the tasks this learner put in Redis and has not resolved
        self.refused = 0  # results that did not decode

    def start(self) -> None:
        """A fresh learner knows no rounds: whatever a previous one left in Redis is dropped."""
        self.retry("evaluation reset", self.client.delete, *self.keys.values())

    def tick(self, gone: list) -> None:
        """Results in, the engines' versions read, silent generators' tasks back, abandoned rounds' tasks out
        (expired here, or given up by the learner: Evaluations.finish), open rounds' tasks dealt."""
        self._drain()
        engines = self.retry("evaluation engines", self.client.hgetall, self.keys["engines"])
        for gen, version in engines.items():  # EVAL_TAKE wrote an integer; anything else is ignored
            if version.isdigit() and len(version) < 19:
                self.evals.note_engine(gen.decode(errors="replace"), int(version))
        if gone:
            self._give_back_held_by(set(gone))
        self.evals.expire()
        still_open = set(self.evals.open_versions())
        stale = [deal for deal, version in self.dealt.items() if version not in still_open]
        for deal in stale:
            del self.dealt[deal]
        if stale:
            self.retry("evaluation cleanup", self._remove, stale)
        tasks = self.evals.deal(LEARNER, 0, 1 << 30)
        if tasks:
            self.retry("evaluation deal", self._publish, tasks)

    def _publish(self, tasks: list) -> None:
        pipe = self.client.pipeline(transaction=True)
        for task in tasks:
            deal, version = task[0], task[1]
            pipe.hset(self.keys["task"], deal, msgpack.packb(task, use_bin_type=True))
            pipe.zadd(self.keys["ready"], {deal: version})
            self.dealt[deal] = version
        pipe.execute()

    def _remove(self, deals: list) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(self.keys["ready"], *deals).hdel(self.keys["task"], *deals).hdel(self.keys["holder"], *deals)
        pipe.execute()

    def _drain(self) -> None:
        def pop():
            pipe = self.client.pipeline(transaction=True)
            pipe.lrange(self.keys["results"], 0, DRAIN - 1).ltrim(self.keys["results"], DRAIN, -1)
            return pipe.execute()[0]

        for raw in self.retry("evaluation results", pop):
            try:
                fields = msgpack.unpackb(raw, raw=False, strict_map_key=False)
                # [deal, rewards, lengths, texts]; a generator of a release before texts sends three
                deal, rewards, lengths, texts = fields if len(fields) == 4 else (*fields, None)
            except Exception as err:  # untrusted bytes
                self.refused += 1
                log.warning("learner: an evaluation result that does not decode (%s) is refused", type(err).__name__)
                continue
            if not isinstance(deal, str) or deal not in self.dealt:
                self.refused += 1
                continue
            self.dealt.pop(deal)
            self.retry("evaluation task", self.client.hdel, self.keys["task"], deal)
            problem = self.evals.result(LEARNER, deal, rewards, lengths, texts)
            if rewards is not None and problem is None:
                continue
            if problem is not None:
                self.rejections.reject("eval_result", "a generator", f"evaluation deal {deal}: {problem}")
            # given back or refused: EvalRounds put the prompt back in its round; it is dealt again next tick

    def _give_back_held_by(self, gone: set) -> None:
        held = self.retry("evaluation holders", self.client.hgetall, self.keys["holder"])
        for deal, holder in held.items():
            deal = deal.decode()
            if holder.decode(errors="replace") in gone and deal in self.dealt:
                self.retry("evaluation give-back", self._remove, [deal])
                del self.dealt[deal]
                self.evals.result(LEARNER, deal, None, None)

    def metrics(self) -> dict:
        return {"eval/refused_results": float(self.refused)} if self.refused else {}
