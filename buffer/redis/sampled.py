"""The rewards of the groups generators filter, through Redis (buffer/sampled.py says why the learner wants them).

A Redis generator's release gives its lease back directly in Redis, so the learner never sees the request: the
client also appends `[generator id, rewards]` (JSON) to one list, `asyncrl:{job}:meta:sampled`, and the learner's
server drains it (`drain_sampled`) while it waits for groups and before each step's metrics. Entries are
hostile input, checked one by one: a bad one is counted under buffer/rejected/release_rewards and ignored. The list
is capped at MAX_PENDING entries from the generator's side (LTRIM), so a learner that is gone or slow leaves at
most that many behind. A release resent through a Redis outage (reconnect.py) may add its entry twice: the tally is
a metric and a stopping rule's evidence, and a duplicate moves neither by more than one group.
"""
import json

from asyncrl.buffer.sampled import check_released_rewards

MAX_PENDING = 10_000
"""Entries kept in the list; older ones are dropped (about 100 bytes each)."""
DRAIN_MAX = 1000
"""Entries read per drain."""
MAX_ENTRY_BYTES = 64 * 1024
"""Larger than any honest entry (rollout.n numbers): a longer one is refused before it is parsed."""


def sampled_key(keys: dict) -> str:
    return keys["meta"] + ":sampled"


def push_sampled(client, keys: dict, generator_id: str, rewards: list) -> None:
    """Append one filtered group's rewards (the generator's side, in its release), keeping the list bounded."""
    pipe = client.pipeline(transaction=False)
    pipe.rpush(sampled_key(keys), json.dumps([generator_id, [float(reward) for reward in rewards]]))
    pipe.ltrim(sampled_key(keys), -MAX_PENDING, -1)
    pipe.execute()


def drain_sampled(client, keys: dict, tally, rejections, group_size: int | None) -> int:
    """Move what generators appended into `tally` (buffer/sampled.py SampledRewards), DRAIN_MAX entries per
    transaction (read the head, trim it off) until the list is empty, at most MAX_PENDING entries a call; each bad
    entry is counted on `rejections` (RejectionLog). Returns the entries read."""
    read = 0
    while read < MAX_PENDING:
        pipe = client.pipeline(transaction=True)
        pipe.lrange(sampled_key(keys), 0, DRAIN_MAX - 1)
        pipe.ltrim(sampled_key(keys), DRAIN_MAX, -1)
        raw, _ = pipe.execute()
        for entry in raw:
            generator, rewards, problem = parse_entry(entry, group_size)
            if problem is None:
                tally.add(rewards)
            else:
                rejections.reject("release_rewards", generator, problem)
        read += len(raw)
        if len(raw) < DRAIN_MAX:
            break
    return read


def parse_entry(entry: bytes, group_size: int | None) -> tuple:
    """(generator id, rewards, None) or (generator id or "a peer", None, why the entry is unusable)."""
    if len(entry) > MAX_ENTRY_BYTES:
        return "a peer", None, f"an entry of {len(entry)} bytes > {MAX_ENTRY_BYTES}"
    try:
        generator, rewards = json.loads(entry)
    except (ValueError, TypeError, RecursionError):
        return "a peer", None, "not a JSON [generator, rewards] pair"
    generator = generator[:64] if isinstance(generator, str) else "a peer"
    return generator, rewards, check_released_rewards(rewards, group_size)
