"""One refusal, one count (zmq; the Redis twin is in tests/integration/test_redis_refusals.py): a real zmq server
and client, every way a dealt group can be refused, and the counters read afterwards. Each refused group moves
exactly one `buffer/rejected/<reason>`; `data/refused` is the count of groups refused for their deal and equals
`buffer/rejected/unknown_deal` (a header/meta deal mismatch was refused before the dealer counted it: 7 against 8);
every prompt a refused group held goes back once, under the reason the Redis learner uses too."""
import asyncio
import dataclasses

import msgpack

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.client import ZmqBufferClient
from asyncrl.buffer.zmq.server import ZmqBufferServer
from tests.conftest import free_port
from tests.messages import run_info
from tests.dealt_rows import decoded, dealer, group_for


def refused_groups(mine: list, theirs) -> list:
    """(what, the reason it is refused for, the deal its header names, its bytes), one per way to be refused; `mine`
    are eight deals out to gen-a, `theirs` one out to gen-b."""
    def payload(group, **wire_fields):
        wire = msgpack.unpackb(encode_group(group), raw=False)
        return msgpack.packb(wire | wire_fields, use_bin_type=True)

    no_deal = group_for(mine[0])
    del no_deal.meta["deal"]
    other_meta = group_for(mine[0])
    other_meta.meta["deal"] = mine[1].deal_id
    late = group_for(mine[7])
    late.samples[0].versions[:] = 5  # sampled by weights this learner never published (a restart discarded them)
    return [
        ("a deal never dealt", "unknown_deal", "forged-1", encode_group(group_for(
            dataclasses.replace(mine[0], deal_id="forged-1")))),
        ("its header names one deal, its meta another", "unknown_deal", mine[0].deal_id, encode_group(other_meta)),
        ("another prompt id", "unknown_deal", mine[2].deal_id, encode_group(group_for(
            dataclasses.replace(mine[2], prompt_id="f.parquet:99")))),
        ("the prompt's tokens swapped", "unknown_deal", mine[3].deal_id, encode_group(group_for(
            dataclasses.replace(mine[3], prompt_ids=[9, 9])))),
        ("another generator's deal", "unknown_deal", theirs.deal_id, encode_group(group_for(theirs))),
        ("no deal at all", "unknown_deal", "", encode_group(no_deal)),
        ("another generator's id", "generator_id", mine[4].deal_id, encode_group(group_for(mine[4], gen="gen-b"))),
        ("not msgpack", "malformed", mine[5].deal_id, b"\xc1 junk"),
        ("over max_message_bytes", "too_large", mine[6].deal_id, payload(group_for(mine[6]), pad="x" * 5000)),
        ("from a future version (dropped, not refused)", None, mine[7].deal_id, encode_group(late)),
    ]


def test_every_refused_group_moves_one_reason_counter_and_data_refused_equals_unknown_deal():
    d = dealer(9, epochs=1)
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(8, 2), vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=32, run_info=run_info(), dealer=d)
    server.start()
    gen_a = ZmqBufferClient(server.endpoint, "gen-a", timeout_s=5)
    gen_b = ZmqBufferClient(server.endpoint, "gen-b", timeout_s=5)

    async def scenario():
        mine = decoded(await gen_a.admit(8)).deals
        (theirs,) = decoded(await gen_b.admit(1)).deals
        cases = refused_groups(mine, theirs)
        for index, (_, _, deal, data) in enumerate(cases):
            await gen_a.send(f"x{index}", data, deal=deal)
        return cases

    try:
        cases = asyncio.run(scenario())
        assert server.take(1.0) is None
        metrics = server.metrics()
    finally:
        gen_a.close()
        gen_b.close()
        server.close()
    expected: dict = {}
    for _, reason, _, _ in cases:
        if reason is not None:
            expected[reason] = expected.get(reason, 0) + 1
    assert server.rejected == expected  # one count per refused group, under its one reason
    assert metrics["data/refused"] == metrics["buffer/rejected/unknown_deal"] == expected["unknown_deal"] == 6
    assert metrics["buffer/dropped/future_version"] == 1
    # the prompts: gen-a's refused deals went back (the forged one and gen-b's were never gen-a's), the future
    # version's as `stale`, as the Redis learner counts it; the one a meta named but no group answered is still out
    assert metrics["data/returned/rejected"] == 6 and metrics["data/returned/stale"] == 1
    assert metrics["data/out"] == 2 and metrics["data/consumed"] == 0
    assert metrics["data/dealt"] == metrics["data/out"] + metrics["data/returned/rejected"] + \
        metrics["data/returned/stale"]
