"""Telling a Redis generator that the learner rejected its groups, as a zmq generator is told in its next reply.

With zmq the learner validates a group when it takes it, after the generator's request was answered, so the server
keeps a count and the last error per generator and puts them in that generator's next reply (buffer/zmq/server.py,
`rejected`). With Redis the learner never answers a generator, and a generator whose groups were all dead-lettered
used to hear nothing: it went on sampling groups nobody would train. Here the learner leaves the news in one hash
beside the run metadata, `asyncrl:{job}:rejections` (`n:<generator>`: groups rejected since it last asked,
`e:<generator>`: the last error), and the generator reads and clears its two fields in the pipeline every control
request (hello, admit, release, stats, bye) already sends, so hearing costs no round trip. Both sides are one script
each, so news added while a generator reads it is never lost. The hash holds at most MAX_GENERATORS generators'
news: a writer naming a new generator per entry cannot grow it without bound. A reply lost to a Redis outage loses
the news it carried (it is news, not accounting: the learner's counters have every rejection).
"""
from asyncrl.buffer.interface import Rejections

MAX_GENERATORS = 4096
MAX_ERROR_CHARS = 1000

TELL = """
-- KEYS[1] the news hash; ARGV[1] the generator, ARGV[2] the error, ARGV[3] the most generators held.
-- A count a writer spoiled (not a number) starts again from 0 rather than failing the learner's call.
local count = 'n:' .. ARGV[1]
local held = redis.call('HGET', KEYS[1], count)
if not held and redis.call('HLEN', KEYS[1]) >= 2 * tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], count, (tonumber(held or '0') or 0) + 1, 'e:' .. ARGV[1], ARGV[2])
return 1
"""

TAKE = "\n".join(line for line in """
-- KEYS[1] the news hash; ARGV[1] the generator. Returns {count, last error} and clears them, or false.
local count = redis.call('HGET', KEYS[1], 'n:' .. ARGV[1])
if not count then return false end
local err = redis.call('HGET', KEYS[1], 'e:' .. ARGV[1]) or ''
redis.call('HDEL', KEYS[1], 'n:' .. ARGV[1], 'e:' .. ARGV[1])
return {count, err}
""".splitlines() if line.strip() and not line.startswith("--"))
"""Sent as EVAL with its body inside the request's pipeline (as stream.DELIVER_BODY is: no SCRIPT EXISTS round
trip)."""


def tell_args(generator_id: str, error: str) -> list:
    """TELL's ARGV for one rejected group."""
    return [generator_id, error[:MAX_ERROR_CHARS], MAX_GENERATORS]


def heard(reply) -> Rejections | None:
    """TAKE's reply as the `Status.rejected` a generator logs; None when there was no news (or none readable: the
    hash is writable by any client of the job, so a spoiled count reads as one rejection)."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 2:
        return None
    count, error = (value.decode(errors="replace") if isinstance(value, bytes) else str(value) for value in reply)
    readable = count.isascii() and count.isdigit() and len(count) <= 9
    return Rejections(int(count) if readable and int(count) > 0 else 1, error[:MAX_ERROR_CHARS])
