"""Refusals of dealt groups with Redis, against a real redis-server (the zmq twin: tests/unit/test_refusal_counts.py):
one count per refused group whoever refuses it (DELIVER, in Redis, or the learner), `data/refused` equal to
`buffer/rejected/unknown_deal`; an entry answering a deal that was never dealt is refused, not skipped as resolved;
and a generator hears of its groups the learner refused with its next request, as a zmq generator does."""
import asyncio
import dataclasses

import pytest

from asyncrl.buffer.codec import encode_group
from tests.integration.test_redis_dealing import admitted, group_for, make_job, send  # noqa: F401 (a fixture)

pytestmark = pytest.mark.redis


def test_every_refused_group_is_counted_once_and_data_refused_equals_unknown_deal(make_job):
    """DELIVER counted its refusals in data/refused and the learner its own in buffer/rejected/unknown_deal: two
    counters for one kind of refusal, neither the total."""
    job = make_job(12, ready=10)
    a, b = job.generator("a"), job.generator("b")
    mine = admitted(a, 8).deals
    (theirs,) = admitted(b, 1).deals
    other_meta = group_for(mine[0], "a")
    other_meta.meta["deal"] = mine[1].deal_id
    late = group_for(mine[6], "a")
    late.samples[0].versions[:] = 5  # weights this learner never published

    def deliver(group, deal, payload=None):
        return asyncio.run(a.send(group.group_id, payload or encode_group(group), deal=deal))

    at_deliver = [deliver(group_for(dataclasses.replace(mine[7], deal_id="forged-1"), "a"), "forged-1"),
                  deliver(group_for(theirs, "a"), theirs.deal_id)]
    assert [(reply.accepted, reply.reason) for reply in at_deliver] == [(False, "unknown_deal")] * 2
    deliver(other_meta, mine[0].deal_id)
    deliver(group_for(dataclasses.replace(mine[2], prompt_id="f.parquet:99"), "a"), mine[2].deal_id)
    deliver(group_for(dataclasses.replace(mine[3], prompt_ids=[9, 9]), "a"), mine[3].deal_id)
    deliver(group_for(mine[7], "a"), "")  # no deal at all
    deliver(group_for(mine[4], "b"), mine[4].deal_id)  # another generator's id
    deliver(group_for(mine[5], "a"), mine[5].deal_id, payload=b"\xc1 junk")
    deliver(late, mine[6].deal_id)
    assert job.take_all() == []
    metrics = job.server.metrics()
    assert job.server.rejected == {"unknown_deal": 6, "generator_id": 1, "malformed": 1}
    assert metrics["data/refused"] == metrics["buffer/rejected/unknown_deal"] == 6
    assert len(job.server.stream.dead_letters()) == 6  # the learner's refusals; DELIVER's never entered the stream
    assert metrics["buffer/dropped/future_version"] == 1
    assert metrics["data/returned/rejected"] == 5 and metrics["data/returned/stale"] == 1
