"""The rollout workers' pooled admission (generator/admission.py), against a scripted learner."""
import asyncio

import pytest

from asyncrl.data.prompts import PromptRow, encode_prompt
from asyncrl.buffer.interface import AdmitReply, Status
from asyncrl.generator.admission import AdmissionGate


class Learner:
    """Grants up to `budget` admissions; records every request; `fail` makes the next admit raise."""

    def __init__(self, budget: int, deals: bool = False):
        self.budget = budget
        self.deals = deals  # deal a prompt with each grant, as a learner with data does (buffer/dealing.py)
        self.dealt = 0
        self.admits: list = []
        self.released = 0
        self.released_deals: list = []
        self.fail = None
        self.answering = asyncio.Event()
        self.answering.set()

    async def admit(self, want=1, version=None):
        await self.answering.wait()
        if self.fail is not None:
            raise self.fail
        granted = min(want, self.budget)
        self.budget -= granted
        self.admits.append((want, granted))
        deals = []
        if self.deals:
            deals = [(f"d{self.dealt + i}", encode_prompt(PromptRow(f"p{self.dealt + i}", [5], "src", None, {})))
                     for i in range(granted)]
            self.dealt += granted
        return AdmitReply(granted=granted, deals=deals)

    async def release(self, count=1, deals=None, outcome="unused", rewards=None):
        self.released += count
        self.released_deals += [(deal, outcome) for deal in deals or ()]
        self.budget += count
        return Status()


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_workers_waiting_together_are_admitted_by_one_request():
    learner = Learner(budget=16)
    gate = AdmissionGate(learner, on_reply=lambda reply: None)

    async def scenario():
        await asyncio.gather(*(gate.take() for _ in range(16)))
        await gate.close()

    run(scenario)
    assert learner.admits == [(16, 16)] and gate.requests == 1 and gate.granted == 16


def test_a_partial_grant_serves_the_oldest_and_the_rest_are_served_when_admissions_free_up():
    learner = Learner(budget=2)
    replies = []
    gate = AdmissionGate(learner, on_reply=replies.append, min_backoff_s=0.01, max_backoff_s=0.02)

    async def scenario():
        order = []

        async def worker(index):
            await gate.take()
            order.append(index)

        tasks = []
        for index in range(4):
            tasks.append(asyncio.create_task(worker(index)))
            await asyncio.sleep(0)  # they queue in index order
        await asyncio.sleep(0.1)
        assert sorted(order) == [0, 1] and learner.admits[0] == (4, 2)
        assert all(granted == 0 for _, granted in learner.admits[1:])  # still asking for the other two
        learner.budget = 2  # the learner took a batch: two more may start
        await asyncio.gather(*tasks)
        await gate.close()
        return order

    assert run(scenario) == [0, 1, 2, 3]
    assert learner.admits[-1] == (2, 2) and len(replies) == len(learner.admits)


def test_a_grant_whose_worker_was_cancelled_is_released_back_to_the_learner():
    learner = Learner(budget=3)
    gate = AdmissionGate(learner, on_reply=lambda reply: None)

    async def scenario():
        learner.answering.clear()  # the request is in flight ...
        tasks = [asyncio.create_task(gate.take()) for _ in range(3)]
        await asyncio.sleep(0.05)
        tasks[1].cancel()  # ... when one worker is cancelled
        learner.answering.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gate.close()

    run(scenario)
    assert learner.admits == [(3, 3)] and learner.released == 1 and learner.budget == 1


def test_the_learners_error_reaches_every_waiting_worker():
    learner = Learner(budget=0)
    learner.fail = TimeoutError("learner at tcp://127.0.0.1:1 did not answer admit within 5 s")
    gate = AdmissionGate(learner, on_reply=lambda reply: None)

    async def scenario():
        results = await asyncio.gather(*(gate.take() for _ in range(3)), return_exceptions=True)
        await gate.close()
        return results

    results = run(scenario)
    assert all(isinstance(result, TimeoutError) and "did not answer" in str(result) for result in results)


def test_a_new_waiter_cuts_the_backoff_short():
    """Turned away, the gate waits up to max_backoff_s; a worker arriving meanwhile (it may have just released an
    admission) makes it ask again at once."""
    learner = Learner(budget=0)
    gate = AdmissionGate(learner, on_reply=lambda reply: None, min_backoff_s=5.0, max_backoff_s=5.0)

    async def scenario():
        first = asyncio.create_task(gate.take())
        await asyncio.sleep(0.05)
        assert learner.admits == [(1, 0)]
        learner.budget = 2
        started = asyncio.get_running_loop().time()
        await gate.take()
        await first
        elapsed = asyncio.get_running_loop().time() - started
        await gate.close()
        return elapsed

    assert run(scenario) < 1.0
    assert learner.admits[-1] == (2, 2)


def test_done_stops_asking_and_close_cancels_the_waiters():
    class Done(Learner):
        async def admit(self, want=1, version=None):
            self.admits.append((want, 0))
            return AdmitReply(done=True, granted=0)

    learner = Done(budget=0)
    gate = AdmissionGate(learner, on_reply=lambda reply: None, min_backoff_s=0.001)

    async def scenario():
        tasks = [asyncio.create_task(gate.take()) for _ in range(2)]
        await asyncio.sleep(0.1)
        await gate.close()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(scenario)
    assert learner.admits == [(2, 0)]  # one request, then no more polling after "done"
    assert all(isinstance(result, asyncio.CancelledError) for result in results)


@pytest.mark.parametrize("granted", [-3, 99])
def test_an_implausible_grant_is_clamped_to_what_was_asked(granted):
    class Odd(Learner):
        async def admit(self, want=1, version=None):
            self.admits.append((want, granted))
            return AdmitReply(granted=granted if not self.admits[1:] else want)

    learner = Odd(budget=0)
    gate = AdmissionGate(learner, on_reply=lambda reply: None, min_backoff_s=0.001)

    async def scenario():
        await asyncio.gather(*(gate.take() for _ in range(2)))
        await gate.close()

    run(scenario)
    assert gate.granted == 2 and learner.released == 0


def test_each_worker_gets_its_own_dealt_prompt_and_a_cancelled_workers_prompt_goes_back():
    learner = Learner(budget=3, deals=True)
    gate = AdmissionGate(learner, on_reply=lambda reply: None)
    got = []

    async def scenario():
        learner.answering.clear()
        tasks = [asyncio.create_task(gate.take()) for _ in range(3)]
        await asyncio.sleep(0.05)
        tasks[1].cancel()
        learner.answering.set()
        got.extend(await asyncio.gather(*tasks, return_exceptions=True))
        await gate.close()

    run(scenario)
    assert [deal.prompt_id for deal in (got[0], got[2])] == ["p0", "p1"]  # the oldest live waiters, in order
    assert learner.released == 1 and learner.released_deals == [("d2", "unused")]
