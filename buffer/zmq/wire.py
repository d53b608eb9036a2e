"""Control messages between generators and the learner's embedded buffer (a msgpack map per frame).

Requests (generator -> learner) carry `op`, `req` (request id), `gen` (generator id) and `wid` (the id of the
weights announcement the generator holds, "" for none):
  hello {config_hash}        -> {version, weights_id, run_info}       # refused if config hashes differ
  admit {want, ver}          -> {granted, deals, evals, version, weights_id, done}
                             # ver: the version the generator's engine holds; evals: held-out prompts of the
                             # evaluation rounds at ver or later, [[id, version, row, n, temperature, max_tokens]]
                             # (buffer/eval_rounds.py), at most half of `want`, beside the grants
                             # deals: [[deal id, row bytes], ...], one per grant, when the learner deals the
                             # prompts (buffer/dealing.py); absent when it does not
  release {count, deals, outcome, rewards} -> {released}              # admissions it will not deliver (filtered);
                             # deals: the dealt prompts' ids, outcome: unused | zero_variance | skipped;
                             # rewards: the filtered group's rewards (buffer/sampled.py), absent when none
  group {deal} + second frame bytes -> {accepted, reason, retry, version, weights_id, done}
                             # deal: the dealt prompt's id ("" when none), so the learner knows the group of a
                             # generator that leaves before it is taken is coming (buffer/dealing.py)
  group {reqs, deals} + one frame per group -> {version, weights_id, done, results: [{req, accepted, reason, retry}]}
                             # several groups in one message (`reqs` lists their request ids, `deals` their deal
                             # ids, in frame order;
                             # the header's other fields are the first request's); each result answers its `req`
  eval {deal, rewards, lengths} -> {}                                 # an evaluation prompt's result; rewards
                             # and lengths nil give it back
  stats {metrics}            -> {}
  bye                        -> {}
Every reply carries `req`, `ok`, `version` (the learner's published version, for a peer that follows no weights;
ZmqBufferClient reads the version from the announcement instead), `weights_id` (of the newest weights), `weights`
(their announcement, weightsync/announcement.py `to_wire`) only when the request's `wid` differs, `error` when ok is
false, and `rejected` {count, last_error} when groups this generator sent earlier were found invalid since its last
reply (the learner validates a group when it takes it, so "accepted" means queued; only an oversized group is
refused in its own reply, with `reason`). ZmqBufferClient keeps the newest announcement (decoded once:
interface.decode_weights), and turns every reply into the typed replies of buffer/interface.py (`status_fields`), so
callers always see `weights`. Group payloads travel in their own frame so the codec's size limit applies to them
alone.
"""
import msgpack

from asyncrl.buffer.interface import Rejections
from asyncrl.weightsync.announcement import WeightsAnnouncement

OPS = ("hello", "admit", "release", "group", "eval", "stats", "bye")
MAX_HEADER_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A control frame that is not a msgpack map with a known `op`."""


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack_request(frame: bytes) -> dict:
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"control frame of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as err:  # any msgpack failure is a malformed frame, never a crash
        raise ProtocolError(f"control frame is not msgpack: {type(err).__name__}") from None
    if not isinstance(message, dict) or message.get("op") not in OPS:
        raise ProtocolError(f"control frame has no known op (expected one of {OPS})")
    if not isinstance(message.get("req"), int) or not isinstance(message.get("gen"), str):
        raise ProtocolError("control frame needs an integer 'req' and a string 'gen'")
    return message


def unpack_reply(frame: bytes) -> dict:
    message = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_ext_len=0)
    if not isinstance(message, dict) or "req" not in message:
        raise ProtocolError("reply is not a map with 'req'")
    return message


def status_fields(reply: dict) -> dict:
    """The `interface.Status` fields of a reply: what every reply carries, with types checked (a field of the wrong
    type reads as absent rather than reaching the rollout loop)."""
    weights = reply.get("weights")
    rejected = reply.get("rejected")
    if isinstance(rejected, dict) and isinstance(rejected.get("count"), int):
        rejected = Rejections(rejected["count"], str(rejected.get("last_error", "")))
    else:
        rejected = None
    return {"weights": weights if isinstance(weights, WeightsAnnouncement) else None,
            "done": reply.get("done") is True, "rejected": rejected}
