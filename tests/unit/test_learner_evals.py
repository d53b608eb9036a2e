"""The learner's side of evaluation rounds (learner/evals.py): rounds open for the due published versions, and
each finished round is logged at the step it evaluated, with how far training had moved on since."""
import asyncio
import logging
import threading
import time
from types import SimpleNamespace

from asyncrl.buffer.eval_rounds import EvalRounds
from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.client import ZmqBufferClient
from asyncrl.buffer.zmq.server import ZmqBufferServer
from asyncrl.data.prompts import PromptRow, encode_prompts
from asyncrl.learner.evals import Evaluations
from tests.conftest import free_port
from tests.messages import run_info



class Record:
    def __init__(self):
        self.logged = []
        self.samples = []

    def log_eval(self, step, metrics):
        self.logged.append((step, metrics))

    def log_eval_samples(self, version, samples):
        self.samples.append((version, samples))


EVAL = SimpleNamespace(every_steps=2, before_train=True, n=2, temperature=0.0, k_values=[1], pass_threshold=0.5,
                       timeout_s=0.5)


def test_due_versions_open_rounds_and_a_finished_round_is_logged_at_its_own_step(caplog):
    caplog.set_level(logging.INFO, logger="asyncrl.learner.evals")
    rows = [PromptRow(f"t:{i}", [3, 4], "a", None, {}) for i in range(2)]
    rounds = EvalRounds(encode_prompts(rows), timeout_s=60.0)
    record = Record()
    evals = Evaluations(rounds, EVAL, max_tokens=8, start_version=0, record=record,
                        source="eval.files: test.parquet")
    for version in (0, 1, 3):  # before training; not due; the first published at or past 2
        evals.open_if_due(version)
    assert rounds.open_versions() == [0, 3]
    first, second = rounds.deal("g", 0, 2)
    assert rounds.result("g", first[0], [1.0, 0.0], [3, 8], ["ab", "c"]) is None  # with the completions' text
    assert rounds.result("g", second[0], [1.0, 0.0], [3, 8]) is None  # a generator that sends none
    assert evals.after_step(published=3) == {"eval/rounds_abandoned": 0.0}
    assert record.samples == [(0, [([3, 4], ["ab", "c"], [1.0, 0.0])])]  # decoded from the learner's own rows
    ((step, metrics),) = record.logged
    assert step == 0 and metrics["eval/lag_steps"] == 3.0 and metrics["eval/all/mean_reward"] == 0.5
    assert "evaluation of v0 on eval.files: test.parquet: mean reward 0.5000" in caplog.text  # names its data
    evals.finish(published=3, live_generators=lambda: [])  # nobody left to answer v3: no wait, given up
    assert rounds.open_versions() == [] and rounds.abandoned == 1 and len(record.logged) == 1


def test_a_job_without_evaluation_prompts_opens_and_logs_nothing():
    evals = Evaluations(None, EVAL, max_tokens=8, start_version=0, record=Record())
    evals.open_if_due(0)
    assert evals.after_step(published=0) == {} and evals.log_finished(0) == 0
    evals.finish(published=0, live_generators=lambda: ["g"])


LONG = SimpleNamespace(**{**vars(EVAL), "timeout_s": 600.0})
"""eval.timeout_s as a job has it: what the end of the job used to wait when a round could not be answered."""


def finish_within(evals, timeout_s: float, **kwargs) -> float:
    """Run Evaluations.finish in a thread (it used to wait eval.timeout_s) and how long it took; fails past
    `timeout_s`."""
    start = time.monotonic()
    waiter = threading.Thread(target=evals.finish, kwargs=kwargs, daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    assert not waiter.is_alive(), f"the end-of-job wait for evaluations took more than {timeout_s} s"
    return time.monotonic() - start


def zmq_fleet(count: int):
    """A real zmq learner-side server dealing a round of `count` prompts, and the Evaluations over it."""
    rows = [PromptRow(f"t:{i}", [3, 4], "a", None, {}) for i in range(count)]
    rounds = EvalRounds(encode_prompts(rows), timeout_s=LONG.timeout_s)
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(4, 2), vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=8, run_info=run_info(evals=True), evals=rounds)
    server.start()
    record = Record()
    return server, Evaluations(rounds, LONG, max_tokens=8, start_version=0, record=record), record


def test_a_round_no_live_engine_can_serve_does_not_hold_the_end_of_the_job(caplog):
    """The v0 round (eval.before_train) is dealt only to engines at v0 or behind; a generator that joined at v1 can
    never take it, and the learner waited eval.timeout_s (600 s) after its last step while that generator lived.
    Now the round is abandoned at once, counted, and the warning names the live engines."""
    server, evals, record = zmq_fleet(2)
    late = ZmqBufferClient(server.endpoint, "late", timeout_s=5)
    try:
        evals.open_if_due(0)
        reply = asyncio.run(late.admit(2, version=1))  # alive, asking, at v1
        assert reply.evals == [] and server.live_generators() == ["late"]
        took = finish_within(evals, 10.0, published=1, live_generators=server.live_generators,
                             serve=server.serve_evals)
    finally:
        late.close()
        server.close()
    assert took < 2.0 and evals.rounds.abandoned == 1 and record.logged == []
    assert "no live generator can serve them" in caplog.text and "'late': 1" in caplog.text


def test_a_prompt_held_and_never_answered_holds_the_end_only_a_few_answer_times(caplog):
    """A live generator at v0 takes both prompts of the v0 round, answers one at once and sits on the other: the
    end of the job waits 3x the slowest answer seen (at least min_patience_s), not eval.timeout_s."""
    server, evals, record = zmq_fleet(2)
    holder = ZmqBufferClient(server.endpoint, "holder", timeout_s=5)
    try:
        evals.open_if_due(0)
        first, _kept = asyncio.run(holder.admit(4, version=0)).evals
        asyncio.run(holder.eval_done(first.deal_id, [1.0, 0.0], [2, 2]))
        took = finish_within(evals, 10.0, published=1, live_generators=server.live_generators,
                             serve=server.serve_evals, min_patience_s=0.5)
    finally:
        holder.close()
        server.close()
    assert 0.5 <= took < 3.0 and evals.rounds.abandoned == 1 and record.logged == []
    assert "no result for" in caplog.text


def test_a_round_still_answering_at_the_end_is_waited_for_and_logged():
    """The wait still serves its purpose: a round whose last prompt lands after the last step is logged."""
    server, evals, record = zmq_fleet(2)
    gen = ZmqBufferClient(server.endpoint, "gen", timeout_s=5)
    try:
        evals.open_if_due(0)
        first, second = asyncio.run(gen.admit(4, version=0)).evals
        asyncio.run(gen.eval_done(first.deal_id, [1.0, 0.0], [2, 2], ["12", "21"]))
        answer_late = threading.Timer(0.5, lambda: asyncio.run(gen.eval_done(second.deal_id, [1.0, 1.0], [2, 2],
                                                                             ["xy", "yx"])))
        answer_late.start()
        took = finish_within(evals, 10.0, published=1, live_generators=server.live_generators,
                             serve=server.serve_evals, min_patience_s=2.0)
        answer_late.join()
    finally:
        gen.close()
        server.close()
    assert took < 2.0 and evals.rounds.abandoned == 0 and [step for step, _ in record.logged] == [0]
    ((version, samples),) = record.samples  # the texts crossed the wire with the rewards
    assert version == 0 and sorted(texts for _, texts, _ in samples) == [["12", "21"], ["xy", "yx"]]
