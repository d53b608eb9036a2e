"""Refusals of dealt groups with Redis, against a real redis-server (the zmq twin: tests/unit/test_refusal_counts.py):
one count per refused group whoever refuses it (DELIVER, in Redis, or the learner), `data/refused` equal to
`buffer/rejected/unknown_deal`; an entry answering a deal that was never dealt is refused, not skipped as resolved;
and a generator hears of its groups the learner refused with its next request, as a zmq generator does."""
import asyncio
import dataclasses

import numpy as np
import pytest

from asyncrl.buffer.codec import encode_group
from asyncrl.data.prompts import decode_prompt
from tests.redis_dealing_job import admitted, group_for, send

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


def test_an_entry_answering_a_deal_never_dealt_is_refused_and_one_already_resolved_is_skipped(make_job):
    """An entry whose deal has no place in Redis was acked as `data/skipped_resolved` with no dead letter and no
    count, whether the learner resolved its deal or nobody ever dealt it; and one naming a deal still waiting in
    `ready` (dealt to nobody) was trained. Only a deal the learner resolved while its entry was pending is skipped
    now; the others were added past DELIVER: refused, counted, dead-lettered."""
    job = make_job(6)
    gen = job.generator("a")
    stale, kept = admitted(gen, 2).deals
    for deal in (stale, kept):
        assert send(gen, group_for(deal, "a")).accepted
    taken = {group.prompt_id: group for group in job.take_all()}
    job.server.give_back(taken[stale.prompt_id], "stale")  # resolved; its entry is acked with the next checkpoint
    job.server.dealer.tick(force=True)
    ready = gen.client.lrange(gen.keys["data_ready"], 0, 0)[0].decode()
    never = [dataclasses.replace(kept, deal_id=deal_id) for deal_id in ("f00dcafe-7", f"{stale.deal_id[:8]}-999")]
    never.append(decode_prompt(ready, gen.client.hget(gen.keys["data_row"], ready)))  # its own prompt and tokens
    for deal in never:
        gen.client.xadd(gen.keys["groups"], {b"g": encode_group(group_for(deal, "a")), b"a": "t", b"l": "",
                                             b"p": "a", b"d": deal.deal_id})
    assert job.take_all() == []
    assert job.server.rejected == {"unknown_deal": 3} and job.server.metrics()["data/refused"] == 3
    assert [fields[b"reason"].count(b"never dealt") for fields in job.server.stream.dead_letters()] == [1, 1, 1]
    restarted = job.learner()  # died before the checkpoint: both genuine entries are read again
    job.server = restarted
    again = job.take_all()
    assert [group.prompt_id for group in again] == [kept.prompt_id]  # owed; the stale one was resolved: skipped
    assert np.array_equal(again[0].prompt_ids, kept.prompt_ids)
    assert restarted.dealer.skipped_resolved == 1 and restarted.rejected == {"unknown_deal": 3}
    assert gen.client.hlen(gen.keys["data_resolved"]) == 0  # the mark went with the skipped entry


def test_a_generator_hears_of_its_groups_the_learner_refused_with_its_next_request(make_job):
    """zmq puts `rejected` in a generator's next reply; a Redis generator was never told. Now the learner leaves
    the news in Redis and the generator's next control request reads and clears it; another generator hears
    nothing, and a count a writer spoiled neither fails the learner nor the generator."""
    job = make_job(6)
    a, b = job.generator("a"), job.generator("b")
    deals = admitted(a, 3).deals
    admitted(b, 1)
    a.client.hset(a.keys["rejections"], "n:a", "not a number")  # any client of the job can write there
    send(a, group_for(dataclasses.replace(deals[0], prompt_ids=[9, 9]), "a"))
    asyncio.run(a.send("junk", b"\xc1 junk", deal=deals[1].deal_id))
    assert job.take_all() == []
    told = asyncio.run(a.admit(0))
    assert told.rejected is not None and told.rejected.count == 2
    assert "malformed" in told.rejected.last_error
    assert asyncio.run(a.admit(0)).rejected is None  # told once
    assert asyncio.run(b.admit(0)).rejected is None
    # a refusal DELIVER answered at once is not told twice
    refused = asyncio.run(a.send("y", encode_group(group_for(deals[0], "a")), deal=deals[0].deal_id))
    assert refused.reason == "unknown_deal" and asyncio.run(a.report({"x": 1.0})).rejected is None


def test_a_refusal_dead_lettered_twice_after_a_lost_reply_is_counted_once(make_job):
    """The reconnect policy resends a dead-letter whole when its reply is lost: the refusal is counted by the attempt
    whose ack took the entry, and only by it."""
    job = make_job(4)
    gen = job.generator("a")
    (deal,) = admitted(gen, 1).deals
    send(gen, group_for(dataclasses.replace(deal, prompt_ids=[9, 9]), "a"))
    (entry,) = job.server.stream.read(10, 100)
    for _ in range(2):  # the same dead-letter, sent again
        job.server.stream.dead_letter(entry.entry_id, entry.payload, "unknown_deal: swapped", refused_deal=True)
    assert job.server.dealer.refused() == 1 and job.server.stream.pending_count() == 0
