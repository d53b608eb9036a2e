"""The end of a job ("done"), in one place: how the learner says it, what a generator does when it hears it, and
how long each side waits. One setting bounds every wait: `buffer.done_grace_s`.

1. **The learner** finishes its last step and its last checkpoint, then calls `LearnerBuffer.finish(grace_s)`. From
   then on every reply says `done` and grants no admission.
   - zmq: the learner keeps serving until every generator heard from within the last `grace_s` has received such a
     reply, for at most `grace_s` (`wait_until_told`). A late joiner still loading its model would otherwise find
     the socket gone, wait out its request timeout, and exit as if the learner had crashed.
   - Redis: the flag stays in the run's metadata, so a generator reads it whenever it next asks; nobody waits.
2. **A generator** hears it in the first reply that says `done` (`JobEnd.hear`). Its rollout workers stop at once,
   including those waiting on a reply the learner will never send. It sends no further request (no stats, no
   bye: the learner has stopped listening), logs its final statistics to MLflow, closes its engine and exits 0,
   also when a request in flight fails with LearnerUnavailable after that.
3. **The supervisor** (`asyncrl run`): once the learner has exited 0, each generator gets `grace_s` to exit on its
   own before it is stopped.

A generator that leaves before the job is done (Ctrl-C, an error) says bye, best effort within `BYE_TIMEOUT_S`: its
undelivered admissions come back at once, instead of after the peer timeout (zmq) or the lease (Redis).
"""
import asyncio
import time
from collections.abc import Callable

BYE_TIMEOUT_S = 1.0
"""How long a leaving generator waits for the answer to its bye: it is a courtesy, the learner reclaims the
admissions of a silent generator anyway."""
POLL_S = 0.05


class JobEnd:
    """A generator's knowledge of the end of the job: set by the first reply that says done, never unset."""

    def __init__(self):
        self._heard = asyncio.Event()

    def hear(self, status) -> None:
        """Note a reply (any `interface.Status`)."""
        if status.done:
            self._heard.set()

    @property
    def heard(self) -> bool:
        return self._heard.is_set()

    async def wait(self) -> None:
        await self._heard.wait()


def wait_until_told(untold: Callable[[float], list[str]], grace_s: float, clock=time.monotonic,
                    sleep=time.sleep) -> list[str]:
    """Learner side (zmq): block until `untold(since)` — the generators heard from after `since` that have not yet
    received a done reply — is empty, for at most `grace_s`; returns those still untold (crashed, or still
    loading)."""
    started = clock()
    while True:
        waiting = untold(started - grace_s)
        if not waiting or clock() - started >= grace_s:
            return waiting
        sleep(POLL_S)
