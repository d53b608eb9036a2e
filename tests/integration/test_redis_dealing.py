"""The dataset cursor in Redis (buffer/redis/dealing.py) against a real redis-server: admission hands out ready
deals in its script, DELIVER refuses a group whose deal is not out to its producer, the learner checks each group
against its deal, returns prompts it will not train, consumes them with the ack, and a restarted learner finds the
deals its stream still owes it."""
import asyncio
import dataclasses
import time

import pytest

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.dealing import DealError
from asyncrl.buffer.redis.dealing import forget_holder, settle_deals
from asyncrl.buffer.redis.stream import REFUSED, GroupStream
from asyncrl.data.prompts import decode_prompt, encode_prompts
from tests.dealt_rows import Row
from tests.redis_dealing_job import Job, admitted, base_dealer, group_for, send

pytestmark = pytest.mark.redis


def eval_prompt_id(task) -> str:
    return decode_prompt(task.deal_id, task.row).prompt_id


def test_admission_deals_ready_prompts_and_a_resend_gets_the_same(make_job):
    job = make_job(6)
    gen = job.generator("a")
    assert gen.deal_ms == 60_000
    reply = admitted(gen, 10)
    assert reply.granted == len(reply.deals) == 4  # never more grants than deals are ready (ready_target 4)
    assert len({deal.prompt_id for deal in reply.deals}) == 4 and all(deal.prompt_ids for deal in reply.deals)
    coordinator = gen.coordinator
    assert admitted(gen, 1).granted == 0  # nothing ready until the learner refills
    job.server.dealer.tick(force=True)
    first = coordinator.admit_dealt("a", 1, 60_000, request_id="same")
    again = coordinator.admit_dealt("a", 1, 60_000, request_id="same")  # a resend after a lost reply
    assert first == again and first[2]
    assert job.server.dealer.metrics()["data/dealt"] == 5 and job.server.dealer.metrics()["data/out"] == 5


def test_a_full_epoch_is_each_prompt_once_and_consumed_with_the_ack(make_job):
    job = make_job(7)
    gens = [job.generator("a"), job.generator("b")]
    trained, receipts = [], []
    while not job.server.dealer.exhausted():
        for gen in gens:
            for deal in admitted(gen, 2).deals:
                assert send(gen, group_for(deal, gen.generator_id)).accepted
        groups = job.take_all()
        trained += [group.prompt_id for group in groups]
        receipts += job.server.take_receipts()
    assert sorted(trained) == sorted(f"f.parquet:{i}" for i in range(7))
    assert all("|" in receipt for receipt in receipts)
    assert job.server.dealer.metrics()["data/consumed"] == 0  # trained, not yet covered by a checkpoint
    job.server.on_checkpoint(receipts)
    metrics = job.server.dealer.metrics()
    assert metrics["data/consumed"] == 7 and metrics["data/out"] == 0 and metrics["data/epoch"] == 1.0
    assert job.server.stream.pending_count() == 0 and job.server.dealer.exhausted()


def test_deliver_refuses_a_deal_not_out_to_the_producer_and_gives_its_lease_back(make_job):
    job = make_job(4)
    a, b = job.generator("a"), job.generator("b")
    deal = admitted(a, 1).deals[0]
    started = a.coordinator.started
    stolen = group_for(deal, "b")  # b answers a deal dealt to a
    admitted(b, 1)
    reply = send(b, stolen)
    assert not reply.accepted and reply.reason == "unknown_deal"
    assert a.coordinator.started == started  # b's lease went back with the refusal
    assert send(a, group_for(deal, "a")).accepted
    twice = send(a, group_for(deal, "a"))  # a second group for the same deal
    assert not twice.accepted and twice.reason == "unknown_deal"
    assert [group.prompt_id for group in job.take_all()] == [deal.prompt_id]
    assert job.server.dealer.metrics()["data/refused"] == 2
    produced = GroupStream(a.client, job.job, producer="a").produce("x", b"junk", "", "never-dealt")
    assert produced == REFUSED


def test_the_learner_checks_each_group_against_its_deal(make_job):
    job = make_job(4)
    gen = job.generator("a")
    deals = admitted(gen, 3).deals
    assert send(gen, group_for(deals[0], "a", prompt_id="f.parquet:99")).accepted  # the wrong prompt
    liar = group_for(deals[1], "a")
    liar.meta["deal"] = deals[2].deal_id  # its meta names another deal than the one it was sent under
    asyncio.run(gen.send(liar.group_id, encode_group(liar), deal=deals[1].deal_id))
    assert job.take_all() == []
    assert job.server.rejected["unknown_deal"] == 2
    metrics = job.server.dealer.metrics()
    assert metrics["data/returned/rejected"] == 2 and metrics["data/out"] == 1  # both prompts back to the epoch
    reasons = [fields[b"reason"].decode() for fields in job.server.stream.dead_letters()]
    assert any("was for prompt" in reason for reason in reasons) and any("its meta" in reason for reason in reasons)
    # a generator that ignores the dealing entirely is refused too
    plain = group_for(deals[2], "a")
    asyncio.run(gen.send(plain.group_id, encode_group(plain), deal=""))
    assert job.take_all() == [] and job.server.rejected["unknown_deal"] == 3


def test_a_group_keeping_its_deal_and_prompt_id_but_not_the_prompt_tokens_is_refused(make_job):
    """The learner compares the group's prompt tokens with the dealt row's (their digest): a swapped prompt is
    dead-lettered, counted, and its prompt dealt again, then trained from an honest group."""
    job = make_job(2)
    gen = job.generator("a")
    (dealt,) = admitted(gen, 1).deals
    swapped = group_for(dataclasses.replace(dealt, prompt_ids=[9] + list(dealt.prompt_ids[1:])), "a")
    assert send(gen, swapped).accepted  # DELIVER sees only the deal, out to its producer
    assert job.take_all() == []
    assert job.server.rejected["unknown_deal"] == 1
    assert any(b"not its prompt tokens" in fields[b"reason"] for fields in job.server.stream.dead_letters())
    job.server.dealer.tick(force=True)
    again = next(deal for deal in admitted(gen, 2).deals if deal.prompt_id == dealt.prompt_id)
    assert send(gen, group_for(again, "a")).accepted
    (taken,) = [group for group in job.take_all() if group.prompt_id == dealt.prompt_id]
    assert taken.prompt_ids.tolist() == dealt.prompt_ids
    assert job.server.dealer.metrics()["data/returned/rejected"] == 1


def test_entries_added_past_deliver_never_train_a_deal_twice(make_job):
    """A writer with Redis access that XADDs straight into the stream: a deal still out, or one the learner holds
    already, is dead-lettered, and the genuine group is trained once."""
    job = make_job(4)
    gen = job.generator("a")
    held, out = admitted(gen, 2).deals
    assert send(gen, group_for(held, "a")).accepted
    assert len(job.take_all()) == 1
    for deal in (held, out):
        forged = group_for(deal, "a")
        gen.client.xadd(gen.keys["groups"], {b"g": encode_group(forged), b"a": "t", b"l": "", b"p": "a",
                                             b"d": deal.deal_id})
    assert job.take_all() == [] and job.server.rejected["unknown_deal"] == 2
    assert send(gen, group_for(out, "a")).accepted  # the genuine one still arrives
    assert [group.prompt_id for group in job.take_all()] == [out.prompt_id]


def test_given_back_groups_return_their_prompts_and_filtered_ones_stay_consumed(make_job):
    job = make_job(5)
    gen = job.generator("a")
    for deal in admitted(gen, 3).deals:
        send(gen, group_for(deal, "a"))
    stale, filtered, kept = job.take_all()
    started = gen.coordinator.started
    job.server.give_back(stale, "stale")
    job.server.give_back(filtered, "zero_variance")
    assert gen.coordinator.started == started - 2  # their admissions with them
    metrics = job.server.dealer.metrics()
    assert metrics["data/returned/stale"] == 1 and metrics["data/filtered/zero_variance"] == 1
    assert metrics["data/consumed"] == 1
    job.server.on_checkpoint(job.server.take_receipts())
    assert job.server.dealer.metrics()["data/consumed"] == 2
    # the stale prompt is dealt again first, before the cursor moves
    job.server.dealer.tick(force=True)
    again = admitted(gen, 10).deals
    assert stale.prompt_id in [deal.prompt_id for deal in again]
    assert {deal.prompt_id for deal in again} | {filtered.prompt_id, kept.prompt_id} == {
        f"f.parquet:{i}" for i in range(5)}


def test_generators_hand_back_unused_and_filtered_deals_and_a_rejoin_frees_its_predecessors(make_job):
    job = make_job(6)
    gen = job.generator("a")
    deals = admitted(gen, 4).deals
    asyncio.run(gen.release(1, deals=[deals[0].deal_id], outcome="unused"))
    asyncio.run(gen.release(1, deals=[deals[1].deal_id], outcome="zero_variance"))
    assert settle_deals(gen.client, gen.keys, "b", [deals[2].deal_id], "unused") == 0  # not b's to hand back
    assert settle_deals(gen.client, gen.keys, "a", [deals[2].deal_id], "made-up") == 0
    from asyncrl.buffer.redis.dealing import SETTLE, STATE_KEYS
    raw = gen.client.eval(SETTLE, len(STATE_KEYS), *[gen.keys[k] for k in STATE_KEYS], "a", "made-up",
                          deals[2].deal_id)  # past the client's check: the script refuses it too
    assert raw == 0
    metrics = job.server.dealer.metrics()
    assert metrics["data/returned/unused"] == 1 and metrics["data/filtered/zero_variance"] == 1
    assert metrics["data/out"] == 2
    job.generator("a")  # the same id joins again (its predecessor was killed with -9): it holds nothing
    metrics = job.server.dealer.metrics()
    assert metrics["data/returned/generator_gone"] == 2 and metrics["data/out"] == 0
    assert not send(gen, group_for(deals[2], "a")).accepted  # the old process's late group is refused
    assert forget_holder(gen.client, gen.keys, "nobody") == 0


def test_deals_past_their_deadline_and_silent_generators_go_back(make_job):
    job = make_job(4)
    gen = job.generator("a")
    gen.deal_ms = 50
    late = admitted(gen, 1).deals[0]
    time.sleep(0.1)
    job.server.dealer.tick(force=True)
    assert job.server.dealer.metrics()["data/returned/expired"] == 1
    assert not send(gen, group_for(late, "a")).accepted
    gen.deal_ms = 60_000
    held = admitted(gen, 2).deals
    job.server.dealer.tick(force=True, gone=["a"])
    assert job.server.dealer.metrics()["data/returned/generator_gone"] == 2
    assert len(held) == 2
    # a generator killed before its first report: silent from when the learner first saw it hold a deal
    admitted(gen, 1)
    job.server.dealer.tick(force=True, last_heard={}, silence_s=0.2)
    assert job.server.dealer.metrics()["data/out"] == 1
    time.sleep(0.3)
    job.server.dealer.tick(force=True, last_heard={"a": time.monotonic()}, silence_s=0.2)  # it reported just now
    assert job.server.dealer.metrics()["data/out"] == 1
    job.server.dealer.tick(force=True, last_heard={}, silence_s=0.2)
    assert job.server.dealer.metrics()["data/returned/generator_gone"] == 3


def test_a_restarted_learner_trains_what_its_stream_owes_and_skips_what_it_resolved(make_job):
    job = make_job(6)
    gen = job.generator("a")
    for deal in admitted(gen, 4).deals:
        send(gen, group_for(deal, "a"))
    trained, stale, owed = [job.server.take(1.0) for _ in range(3)]
    job.server.give_back(stale, "stale")
    checkpoint = [receipt for receipt in job.server.take_receipts() if receipt.endswith(trained.meta["deal"])]
    job.server.on_checkpoint(checkpoint)  # the step with `trained` was checkpointed; then the learner dies
    restarted = job.learner()
    job.server = restarted
    again = job.take_all()
    # `owed` (taken, never checkpointed) and the unread one come back; `stale` was returned before the crash
    assert len(again) == 2 and owed.group_id in {group.group_id for group in again}
    assert restarted.dealer.skipped_resolved == 1
    metrics = restarted.dealer.metrics()
    assert metrics["data/consumed"] == 1 and metrics["data/returned/stale"] == 1


def test_a_cursor_of_other_data_is_refused(make_job):
    job = make_job(4)
    with pytest.raises(DealError, match="another dataset"):
        job.learner(base_dealer(5))


def test_a_redis_without_the_cursor_starts_from_the_checkpoints(make_job, redis_server):
    base = base_dealer(4)
    job = make_job(4)
    gen = job.generator("a")
    deals = admitted(gen, 2).deals
    snapshot = job.server.dealer.snapshot()
    assert sorted(map(tuple, snapshot["out"])) == sorted((0, int(d.prompt_id.split(":")[1])) for d in deals)
    base.restore(snapshot)
    fresh = Job(redis_server.url, 4, base=base)  # an empty namespace: the Redis that lost its data
    try:
        metrics = fresh.server.dealer.metrics()
        assert metrics["data/returned/restart"] == 2
        gen2 = fresh.generator("a")
        dealt = {deal.prompt_id for deal in admitted(gen2, 10).deals}
        assert {deal.prompt_id for deal in deals} <= dealt  # the prompts out then are dealt first
    finally:
        fresh.close()


def eval_rows(count: int) -> list:
    return [Row(f"heldout:{i}", [5, 6 + i], data_source="openai/gsm8k" if i % 2 else "math") for i in range(count)]


def test_evaluation_rounds_are_dealt_through_redis_pinned_to_their_version(make_job):
    """The learner's rounds (buffer/eval_rounds.py) through buffer/redis/eval_bridge.py: a generator gets prompts
    of rounds at or after its engine's version, at most half its request; results come back checked; a refused or
    given-back prompt is dealt again; the round finishes with every prompt's result."""
    from asyncrl.buffer.eval_rounds import EvalRounds

    rows = eval_rows(3)
    evals = EvalRounds(encode_prompts(rows), timeout_s=60)
    job = make_job(8, evals=evals)
    gen = job.generator("a")
    assert gen.evaluates
    evals.open(0, 2, 0.0, 8)
    job.take_all(0.3)  # the learner's tick deals the round into Redis
    ahead = admitted(gen, 4, version=1)  # an engine past v0 cannot evaluate v0
    assert ahead.evals == [] and ahead.granted == 4
    job.server.dealer.tick(force=True)
    first = admitted(gen, 4, version=0)
    assert len(first.evals) == 2 and first.granted == 2  # at most half of the request
    task, other = first.evals
    assert task.version == 0 and task.n == 2 and eval_prompt_id(task).startswith("heldout:")
    asyncio.run(gen.eval_done(task.deal_id, [1.0, 0.0], [3, 4], ["abc", "dcba"]))  # with the completions' text
    asyncio.run(gen.eval_done(other.deal_id, [1.0], [3]))  # implausible: one result for n = 2
    asyncio.run(gen.eval_done(task.deal_id, [1.0, 1.0], [3, 4]))  # answered twice: the second is not its to give
    job.take_all(0.3)
    assert evals.refused == 1 and evals.finished() == []
    rest = admitted(gen, 8, version=0).evals  # the third prompt, and the refused one dealt again
    assert sorted(eval_prompt_id(t) for t in rest) == sorted(
        {r.prompt_id for r in rows} - {eval_prompt_id(task)})
    for t in rest:
        asyncio.run(gen.eval_done(t.deal_id, [0.5, 0.5], [2, 2]))
    job.take_all(0.3)
    (finished,) = evals.finished()
    assert finished.version == 0 and len(finished.results) == 3
    assert [texts for _, texts, _ in finished.samples] == [["abc", "dcba"]]  # only the result that sent them
    gen.client.rpush(job.server.evals.keys["results"], b"\xc1 not msgpack")  # hostile bytes in the results
    job.take_all(0.3)
    assert job.server.metrics()["eval/refused_results"] == 1


def test_a_silent_generators_evaluation_prompts_are_dealt_again(make_job):
    from asyncrl.buffer.eval_rounds import EvalRounds

    rows = eval_rows(2)
    evals = EvalRounds(encode_prompts(rows), timeout_s=60)
    job = make_job(4, evals=evals)
    a, b = job.generator("a"), job.generator("b")
    evals.open(3, 1, 0.0, 8)
    job.take_all(0.3)
    held = admitted(a, 4, version=3).evals
    assert len(held) == 2 and admitted(b, 4, version=3).evals == []
    job.server.evals.tick(gone=["a"])
    again = admitted(b, 4, version=3).evals
    assert sorted(eval_prompt_id(t) for t in again) == sorted(eval_prompt_id(t) for t in held)
    asyncio.run(a.eval_done(held[0].deal_id, [1.0], [1]))  # the silent one's late answer counts for nothing
    for t in again:
        asyncio.run(b.eval_done(t.deal_id, [1.0], [1]))
    job.take_all(0.3)
    (finished,) = evals.finished()
    assert finished.version == 3 and evals.refused == 0


def test_an_admission_with_malformed_fields_is_refused_by_the_scripts_and_counted(make_job):
    """A generator runs the admission scripts itself, so they refuse what the zmq learner refuses: a want that is
    not an integer >= 0 (-5 used to take capacity away from `started`), an engine version below 0 (v-7 was dealt
    the v0 round), more evaluation prompts than one request may take. Each is an error reply naming the field,
    counted under buffer/rejected/malformed; nothing is granted, dealt or taken. The client refuses them before
    asking."""
    import redis

    from asyncrl.buffer.eval_rounds import EvalRounds
    from asyncrl.buffer.redis.eval_bridge import take_evals

    evals = EvalRounds(encode_prompts(eval_rows(4)), timeout_s=60)
    job = make_job(8, evals=evals)
    gen = job.generator("rogue")
    evals.open(0, 1, 0.0, 8)
    job.take_all(0.3)
    job.server.dealer.tick(force=True)
    for want, version in [(-5, None), ("all", None), (1e9, None), (4, -7)]:
        reply = admitted(gen, want, version=version)
        assert (reply.granted, reply.deals, reply.evals) == (0, [], [])
    with pytest.raises(redis.ResponseError, match=r"want -5 .*\[malformed\]"):
        gen.coordinator.admit_dealt("rogue", -5, gen.deal_ms, request_id="rogue:r1")
    with pytest.raises(redis.ResponseError, match=r"version -7 .*\[malformed\]"):
        take_evals(gen.client, gen.keys, "rogue", -7, 2, "rogue:r2", 60_000)
    with pytest.raises(redis.ResponseError, match=r"most 100 .*\[malformed\]"):
        take_evals(gen.client, gen.keys, "rogue", 0, 100, "rogue:r3", 60_000)
    assert job.server.metrics()["buffer/rejected/malformed"] == 3 and gen.coordinator.started == 0
    served = admitted(gen, 4, version=0)
    assert len(served.evals) == 2 and served.granted == 2


def test_an_evaluation_result_the_training_path_would_refuse_is_refused_and_counted(make_job):
    """A reward of 1e300 (finite as a float64, inf as the float32 rewards are trained in) is refused through Redis
    as through zmq: counted under buffer/rejected/eval_result, the prompt dealt again."""
    from asyncrl.buffer.eval_rounds import EvalRounds

    evals = EvalRounds(encode_prompts(eval_rows(1)), timeout_s=60)
    job = make_job(4, evals=evals)
    gen = job.generator("a")
    evals.open(0, 2, 0.0, 8)
    job.take_all(0.3)
    (task,) = admitted(gen, 2, version=0).evals
    asyncio.run(gen.eval_done(task.deal_id, [1e300, 1.0], [3, 4]))
    job.take_all(0.3)
    assert evals.refused == 1 and evals.finished() == []
    assert job.server.metrics()["buffer/rejected/eval_result"] == 1
    (again,) = admitted(gen, 2, version=0).evals  # dealt again
    assert eval_prompt_id(again) == eval_prompt_id(task)


def test_a_round_no_live_engine_can_serve_does_not_hold_the_end_of_the_job_with_redis(make_job):
    """With Redis as with zmq: a live generator whose engine is at v1 (EVAL_TAKE records it) can never take the v0
    round, so the end-of-job wait abandons it at once instead of waiting eval.timeout_s, and its prompts leave
    Redis."""
    import threading
    from types import SimpleNamespace

    from asyncrl.buffer.eval_rounds import EvalRounds
    from asyncrl.learner.evals import Evaluations

    evals = EvalRounds(encode_prompts(eval_rows(2)), timeout_s=600)
    job = make_job(4, evals=evals)
    late = job.generator("late")
    cfg = SimpleNamespace(every_steps=0, before_train=True, n=1, temperature=0.0, k_values=[1], pass_threshold=0.5,
                          timeout_s=600.0)
    evaluations = Evaluations(evals, cfg, max_tokens=8, start_version=0, record=None)
    evaluations.open_if_due(0)
    job.take_all(0.3)  # the round's prompts go to Redis
    assert admitted(late, 2, version=1).evals == []
    asyncio.run(late.report({"generator/tokens_per_s": 1.0}))
    assert job.server.live_generators() == ["late"]
    waiter = threading.Thread(target=evaluations.finish, daemon=True, kwargs=dict(
        published=1, live_generators=job.server.live_generators, serve=job.server.serve_evals))
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive() and evals.abandoned == 1 and evals.engines == {"late": 1}
    job.server.serve_evals()
    assert late.client.zcard(job.server.evals.keys["ready"]) == 0


def test_a_generator_that_has_not_reported_stats_is_alive_and_its_last_evaluation_is_waited_for(make_job, caplog):
    """Liveness with Redis comes from any request, as with zmq: a generator that has asked for admissions but not
    yet reported stats is live, so the end-of-job wait serves and logs the round it is answering (it used to end at
    once, saying eval.timeout_s had run out); a generator that said bye is not live."""
    import logging
    import threading
    from types import SimpleNamespace

    from asyncrl.buffer.eval_rounds import EvalRounds
    from asyncrl.learner.evals import Evaluations

    caplog.set_level(logging.INFO, logger="asyncrl.learner.evals")
    logged = []
    evals = EvalRounds(encode_prompts(eval_rows(2)), timeout_s=600)
    job = make_job(4, evals=evals)
    gen = job.generator("fresh")
    cfg = SimpleNamespace(every_steps=0, before_train=True, n=1, temperature=0.0, k_values=[1], pass_threshold=0.5,
                          timeout_s=600.0)
    evaluations = Evaluations(evals, cfg, max_tokens=8, start_version=0,
                              record=SimpleNamespace(log_eval=lambda step, metrics: logged.append(step),
                                                     log_eval_samples=lambda version, samples: None))
    evaluations.open_if_due(0)
    job.take_all(0.3)
    first, second = admitted(gen, 4, version=0).evals
    assert job.server.live_generators() == ["fresh"]  # no stats report yet
    asyncio.run(gen.eval_done(first.deal_id, [1.0], [2]))
    late = threading.Timer(0.5, lambda: asyncio.run(gen.eval_done(second.deal_id, [0.0], [2])))
    late.start()
    evaluations.finish(published=1, live_generators=job.server.live_generators, serve=job.server.serve_evals,
                       min_patience_s=3.0)
    late.join()
    assert logged == [0] and evals.abandoned == 0
    assert "waited" in caplog.text and "0 rounds abandoned" in caplog.text
    asyncio.run(gen.bye())
    assert job.server.live_generators() == []
