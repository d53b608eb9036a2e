"""The learner's dataset cursor (buffer/dealing.py): every prompt of an epoch trained once, whatever the fleet does,
and a real zmq server and client dealing prompts with the admissions (their rows encoded and decoded by
data/prompts.py)."""
import asyncio
import dataclasses

import msgpack
import pytest

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.dealing import DealAnswer, DealError, check_deal, epoch_order, prompt_digest
from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.client import ZmqBufferClient
from asyncrl.buffer.zmq.server import ZmqBufferServer
from asyncrl.data.prompts import decode_prompt
from tests.conftest import free_port
from tests.dealt_rows import Clock, Row, dealer, decoded, group_for, rows
from tests.messages import run_info


def prompt_of(deal):
    return decode_prompt(*deal).prompt_id


def said(deal_id, prompt_id, tokens=None):
    """What a group sent under `deal_id` says it answers (its prompt tokens compared when given)."""
    return DealAnswer(deal_id, prompt_id, None if tokens is None else prompt_digest(tokens))


def test_a_deal_is_checked_as_deal_id_and_row_bytes_before_the_generator_decodes_it():
    assert check_deal(["d1", b"row"]) == ("d1", b"row")
    for entry in (None, ["d1"], ["d1", "row"], [1, b"row"], ["d1", b"row", 3]):
        with pytest.raises(DealError, match="deal id, row bytes"):
            check_deal(entry)


def test_one_epoch_deals_every_prompt_once_in_a_seeded_order_then_runs_dry():
    d = dealer(6)
    dealt = d.deal("g1", 4) + d.deal("g2", 4)
    assert len(dealt) == 6 and d.available() == 0 and d.deal("g1", 1) == []
    order = [int(prompt_of(deal).split(":")[1]) for deal in dealt]
    assert order == epoch_order(6, 0, True, 7) and sorted(order) == list(range(6)) and order != list(range(6))
    assert not d.exhausted()  # dealt, not yet delivered
    for holder, deal in [("g1", dealt[i]) for i in range(4)] + [("g2", dealt[i]) for i in range(4, 6)]:
        assert d.accept(holder, deal[0], said(deal[0], prompt_of(deal))) is None
    assert d.exhausted() and d.metrics()["data/consumed"] == 6


def test_returned_prompts_are_dealt_again_first_and_filtered_ones_stay_consumed():
    d = dealer(6)
    a, b, c, e = d.deal("g1", 4)
    d.accept("g1", a[0], said(a[0], prompt_of(a)))
    d.accept("g1", b[0], said(b[0], prompt_of(b)))
    assert d.give_back(a[0], "stale") and d.give_back(b[0], "zero_variance")
    assert d.settle("g1", [c[0]], "unused") == 1 and d.settle("g1", [e[0]], "skipped") == 1
    again = d.deal("g2", 2)
    assert [prompt_of(deal) for deal in again] == [prompt_of(a), prompt_of(c)]  # returned first, in order
    metrics = d.metrics()
    assert metrics["data/returned/stale"] == 1 and metrics["data/returned/unused"] == 1
    assert metrics["data/filtered/zero_variance"] == 1 and metrics["data/filtered/skipped"] == 1


def test_a_generator_cannot_deliver_or_settle_what_it_was_not_dealt():
    d = dealer(6)
    (mine,) = d.deal("g1", 1)
    assert "not out to 'g2'" in d.accept("g2", mine[0], said(mine[0], prompt_of(mine)))
    assert "was for prompt" in d.accept("g1", mine[0], said(mine[0], "f.parquet:99"))
    assert "not out" in d.accept("g1", "forged-1", said("forged-1", prompt_of(mine)))
    assert d.accept("g1", 12345, said(12345, "x")) is not None  # not even a string
    assert d.settle("g2", [mine[0]], "skipped") == 0 and d.settle("g1", [mine[0]] * 5, "bogus") == 0
    assert d.settle("g1", "not-a-list", "unused") == 0
    assert d.accept("g1", mine[0], said(mine[0], prompt_of(mine))) is None
    assert d.accept("g1", mine[0], said(mine[0], prompt_of(mine))) is not None  # delivered once only
    assert d.metrics()["data/refused"] == 5


def test_a_dead_generators_prompts_and_expired_deals_go_back_to_the_epoch():
    clock = Clock()
    d = dealer(6, timeout_s=10.0, clock=clock)
    held = d.deal("dead", 2)
    clock.now = 5.0
    late = d.deal("slow", 1)
    assert d.forget("dead") == 2 and d.metrics()["data/returned/generator_gone"] == 2
    clock.now = 16.0
    assert d.expire() == 1 and d.metrics()["data/returned/expired"] == 1
    assert d.accept("slow", late[0][0], said(late[0][0], prompt_of(late[0]))) is not None  # its prompt was dealt again
    assert [prompt_of(x) for x in d.deal("g", 3)] == [prompt_of(held[0]), prompt_of(held[1]), prompt_of(late[0])]


def test_a_delivered_group_outlives_its_generator_and_an_invalid_one_returns_its_prompt():
    clock = Clock()
    d = dealer(6, timeout_s=10.0, clock=clock)
    a, b, c = d.deal("g1", 3)
    assert d.delivered("g1", a[0]) and d.delivered("g1", b[0]) and not d.delivered("g2", c[0])
    assert d.forget("g1") == 1  # only c, which it never delivered
    clock.now = 60.0
    assert d.expire() == 0  # delivered deals wait for the learner, however long
    assert d.reject("g1", b[0]) and d.metrics()["data/returned/rejected"] == 1
    assert d.accept("g1", a[0], said(a[0], prompt_of(a))) is None
    assert [prompt_of(x) for x in d.deal("g2", 2)] == [prompt_of(c), prompt_of(b)]


def test_epochs_reshuffle_and_each_prompt_appears_once_per_epoch():
    d = dealer(5, epochs=3)
    seen = []
    while d.available():
        for deal in d.deal("g", 2):
            assert d.accept("g", deal[0], said(deal[0], prompt_of(deal))) is None
            seen.append(prompt_of(deal))
    assert len(seen) == 15 and d.exhausted() and d.metrics()["data/epoch"] == pytest.approx(3.0)
    epochs = [seen[i * 5:(i + 1) * 5] for i in range(3)]
    assert all(sorted(epoch) == sorted(epochs[0]) for epoch in epochs) and epochs[0] != epochs[1]
    assert dealer(3, epochs=None).available() > 10**6  # without data.epochs it never runs dry


def test_a_restored_cursor_deals_exactly_what_the_checkpoint_had_not_trained():
    """Trained prompts stay trained; the prompts out at the checkpoint, and the rest of the epoch, are dealt again;
    groups dealt before the restart are refused after it."""
    first = dealer(8)
    trained = []
    for deal in first.deal("g1", 3):
        first.accept("g1", deal[0], said(deal[0], prompt_of(deal)))
        trained.append(prompt_of(deal))
    out = first.deal("g2", 2)  # in flight when the checkpoint is written
    state = first.snapshot()
    after = first.deal("g1", 2)  # dealt after the checkpoint, lost with the learner
    second = dealer(8)
    second.restore(state)
    assert second.accept("g2", out[0][0], said(out[0][0], prompt_of(out[0]))) is not None  # an older incarnation's deal
    rest = [prompt_of(deal) for deal in second.deal("g3", 10)]
    assert rest[:2] == [prompt_of(deal) for deal in out] and prompt_of(after[0]) in rest
    assert sorted(trained + rest) == sorted(row.prompt_id for row in rows(8))
    assert second.metrics()["data/returned/restart"] == 2
    with pytest.raises(DealError, match="another dataset"):
        dealer(9).restore(state)


def test_the_zmq_buffer_deals_with_admissions_and_refuses_groups_outside_their_deal():
    d = dealer(4, epochs=1)
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(4, 2), vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=8, run_info=run_info(), dealer=d)
    server.start()
    gen_a = ZmqBufferClient(server.endpoint, "gen-a", timeout_s=5)
    gen_b = ZmqBufferClient(server.endpoint, "gen-b", timeout_s=5)

    async def scenario():
        first = decoded(await gen_a.admit(3))
        other = decoded(await gen_b.admit(3))  # only one prompt is left
        undealt = dataclasses.replace(first.deals[0], deal_id="forged-9")
        for payload in (encode_group(group_for(first.deals[0])),  # valid
                        encode_group(group_for(other.deals[0], gen="gen-a")),  # another's deal, under its own id
                        encode_group(group_for(undealt))):  # never dealt
            await gen_a.send("x", payload, deal=msgpack.unpackb(payload)["meta"]["deal"])
        await gen_a.release(1, deals=[first.deals[1].deal_id], outcome="zero_variance")
        await gen_a.bye()  # its third prompt goes back
        again = decoded(await gen_b.admit(3))
        return first, other, again

    try:
        first, other, again = asyncio.run(scenario())
        taken = server.take(1.0)
        assert server.take(0.3) is None  # the other two were refused
    finally:
        gen_a.close()
        gen_b.close()
        server.close()
    assert (first.granted, len(first.deals), other.granted) == (3, 3, 1)
    assert taken.prompt_id == first.deals[0].prompt_id
    assert server.rejected == {"unknown_deal": 2}
    assert [deal.prompt_id for deal in again.deals] == [first.deals[2].prompt_id]
    metrics = server.metrics()
    # the valid group was delivered before gen-a left: it is still taken; its undelivered third prompt went back
    assert metrics["data/filtered/zero_variance"] == 1 and metrics["data/returned/generator_gone"] == 1
    assert metrics["data/consumed"] == 2 and metrics["buffer/rejected/unknown_deal"] == 2


def test_a_generator_restarted_under_its_id_gets_back_what_its_dead_life_held_and_a_second_hello_keeps_it():
    """Ray restarts a killed generator under the same id, so it is never silent long enough to be forgotten: its
    new process's hello (a new `life`) gives back the dead life's deals and admissions; the same process saying
    hello again (generator/main.py does, before loading its engine) keeps them."""
    d = dealer(4, epochs=1)
    coordinator = Coordinator(4, 2)
    server = ZmqBufferServer("127.0.0.1", free_port(), coordinator, vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=8, run_info=run_info(), dealer=d)
    server.start()
    first_life = ZmqBufferClient(server.endpoint, "gen-0", timeout_s=5)
    second_life = ZmqBufferClient(server.endpoint, "gen-0", timeout_s=5)

    async def scenario():
        await first_life.hello("h")
        held = decoded(await first_life.admit(3))
        await first_life.hello("h")  # the same process again: nothing goes back
        kept = server.metrics().get("data/returned/generator_gone", 0.0)
        await second_life.hello("h")  # the restarted process
        again = decoded(await second_life.admit(4))
        return held, kept, again

    try:
        held, kept, again = asyncio.run(scenario())
        metrics = server.metrics()
    finally:
        first_life.close()
        second_life.close()
        server.close()
    assert held.granted == 3 and kept == 0.0
    assert metrics["data/returned/generator_gone"] == 3
    # the dead life's three prompts are dealt again, with the one never dealt: the whole epoch
    assert sorted(deal.prompt_id for deal in again.deals) == [row.prompt_id for row in rows(4)]
    assert again.granted == 4



def test_a_group_keeping_its_deal_and_prompt_id_but_not_the_prompt_tokens_is_refused_and_its_prompt_dealt_again():
    """A generator that swaps the dealt prompt's tokens (keeping the deal and the prompt id) would have its group
    trained, and recorded in trained_groups.jsonl, as the dealt prompt: the tokens are compared too (their
    digest), the refusal counted once, and the prompt dealt again."""
    d = dealer(2, epochs=1)
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(4, 2), vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=8, run_info=run_info(), dealer=d)
    server.start()
    gen = ZmqBufferClient(server.endpoint, "gen-a", timeout_s=5)

    async def send(deal, prompt_ids):
        group = group_for(dataclasses.replace(deal, prompt_ids=prompt_ids))
        await gen.send(group.group_id, encode_group(group), deal=deal.deal_id)

    async def scenario():
        (dealt,) = decoded(await gen.admit(1)).deals
        await send(dealt, [9] + list(dealt.prompt_ids[1:]))  # one token swapped
        refused = server.take(1.0)
        (again,) = decoded(await gen.admit(1)).deals
        await send(again, again.prompt_ids)
        return dealt, again, refused, server.take(1.0)

    try:
        dealt, again, refused, taken = asyncio.run(scenario())
        metrics = server.metrics()
    finally:
        gen.close()
        server.close()
    assert refused is None and again.prompt_id == dealt.prompt_id and again.deal_id != dealt.deal_id
    assert taken.prompt_id == dealt.prompt_id and taken.prompt_ids.tolist() == dealt.prompt_ids
    assert metrics["buffer/rejected/unknown_deal"] == metrics["data/refused"] == 1
    assert metrics["data/returned/rejected"] == 1 and metrics["data/consumed"] == 1
