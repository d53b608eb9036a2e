"""Admission asked for in bulk: one request for every rollout worker that is waiting, instead of one each.

Why: the engines batch whatever requests arrive together (the hf engine decodes them in one batch; vLLM schedules
them in one step), and a decode step costs about the same for few sequences as for many. Workers that each polled
the learner with their own backoff would wake at scattered times after it publishes a version, and the engine would
decode their groups a few at a time, paying the per-step cost for each. Asked for together, the grants of one reply
start together and are decoded in one batch.

Contract of `AdmissionGate.take()`: it returns once this caller holds one admission (which it must later use or
release), with the prompt the learner dealt for it (a `PromptRow`, decoded here: data/prompts.py; None when the
learner deals none), or with an
evaluation prompt (an `EvalTask`, buffer/eval_rounds.py, which holds no admission); it raises what the learner's
client raised. It waits on: the learner's reply to the pooled request, and
while the learner says no, a backoff (`min_backoff_s` doubling to `max_backoff_s`) cut short when another worker
starts waiting (it may bring a released admission with it). One request is in flight at a time. A caller cancelled
while waiting takes nothing with it: a grant that finds its caller gone is released again, with its prompt.
"""
import asyncio
from collections import deque

from asyncrl.data.prompts import decode_prompt


class AdmissionGate:
    def __init__(self, client, on_reply, coalesce_s: float = 0.002, min_backoff_s: float = 0.01,
                 max_backoff_s: float = 0.05, version_of=lambda: None):
        self.client = client  # interface.GeneratorBuffer: admit(want, version), release(count), eval_done
        self.version_of = version_of  # the engine's weight version, told with each request (evaluation rounds)
        self.on_reply = on_reply  # called with every reply (versions, "done", rejections)
        self.coalesce_s = coalesce_s
        """How long the pump waits after waking, so that workers finishing together ask together."""
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.requests = 0  # admit requests sent, and the admissions they were granted: how well grants were pooled
        self.granted = 0
        self._waiters: deque = deque()
        self._arrived = asyncio.Event()
        self._pump: asyncio.Task | None = None

    async def take(self):
        """Wait until this caller holds one admission or evaluation prompt; returns its dealt prompt (a PromptRow
        with its deal id), an EvalTask, or None."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._arrived.set()
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        return await waiter

    async def close(self) -> None:
        """Stop asking (the job is over or the loop is stopping); waiting callers are cancelled."""
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        for waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()

    def _live_waiters(self) -> int:
        live = [waiter for waiter in self._waiters if not waiter.done()]
        self._waiters = deque(live)
        return len(live)

    async def _run(self) -> None:
        """Ask for as many admissions as there are waiters until none is left waiting."""
        backoff = self.min_backoff_s
        try:
            while True:
                await asyncio.sleep(self.coalesce_s)
                want = self._live_waiters()
                if not want:
                    return
                self._arrived.clear()
                reply = await self.client.admit(want, version=self.version_of())
                self.requests += 1
                self.on_reply(reply)
                granted = max(0, min(int(reply.granted), want))
                self.granted += granted
                await self._hand_out(granted, reply.deals, reply.evals)
                if granted or reply.evals:
                    backoff = self.min_backoff_s
                    continue
                if reply.done:
                    return  # nothing more will be granted; the rollout loop stops its workers
                try:  # turned away: ask again after the backoff, or as soon as another worker starts waiting
                    await asyncio.wait_for(self._arrived.wait(), backoff)
                except asyncio.TimeoutError:
                    backoff = min(backoff * 2, self.max_backoff_s)
        except Exception as err:  # the learner is gone or answered nonsense: every waiter hears it
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_exception(err)
            self._waiters.clear()

    async def _hand_out(self, granted: int, deals: list, evals: list = ()) -> None:
        """The evaluation prompts first, then one admission, with its dealt prompt if any, to each of the oldest
        `granted` waiters; grants whose caller was cancelled meanwhile go back to the learner, their prompts to the
        epoch, and evaluation prompts to their round."""
        unplaced = list(evals)
        while unplaced and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(unplaced.pop(0))
        for task in unplaced:
            self.on_reply(await self.client.eval_done(task.deal_id, None, None))
        deals = [decode_prompt(deal_id, row) for deal_id, row in deals]
        handed = 0
        while handed < granted and self._waiters:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            waiter.set_result(deals[handed] if handed < len(deals) else None)
            handed += 1
        if handed < granted:
            unused = [deal.deal_id for deal in deals[handed:granted]]
            self.on_reply(await self.client.release(granted - handed, deals=unused))
