"""A generator that reaches a learner which has already finished the job stops at once, with success: it loads no
model, and does not wait out a weight fetch from a learner about to close (seen in CI: a generator restarted while
the resumed learner trained the last prompts waited 60 s for the closed catch-up server, then failed)."""
import asyncio
import threading

import pytest

from asyncrl.buffer.interface import LearnerUnavailable
from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.server import ZmqBufferServer
from asyncrl.configs import load_config, shared_hash
from asyncrl.generator.main import run_generator_async, wait_for_learner
from tests.conftest import free_port
from tests.messages import run_info


def test_a_generator_that_joins_a_finished_job_exits_zero_without_loading_anything():
    port = free_port()
    cfg = load_config(None, [f"buffer.port={port}", "model.path=/nonexistent/model", "generator.generator_id=late",
                             "buffer.request_timeout_s=5", "generator.connect_timeout_s=10"])
    server = ZmqBufferServer("127.0.0.1", port, Coordinator(1, 2), vocab_size=16, config_hash=shared_hash(cfg),
                             max_message_bytes=4096, queue_groups=2,
                             run_info=run_info())
    server.start()
    said = []
    try:
        finishing = threading.Thread(target=server.finish, args=(5.0,))  # keeps answering until "late" is told
        finishing.start()
        code = asyncio.run(run_generator_async(cfg, say=said.append))
        finishing.join(timeout=10)
        told = set(server.told_done)
    finally:
        server.close()
    assert code == 0
    assert any("has finished the job" in line for line in said), said
    assert "late" in told and not finishing.is_alive()


class SlowLearner:
    """A client whose learner misses `misses` hellos (as a resuming learner busy restoring its state does), then
    answers."""
    endpoint = "tcp://127.0.0.1:1"
    generator_id = "slow"

    def __init__(self, misses: int):
        self.misses, self.calls = misses, 0

    async def hello(self, config_hash, timeout_s):
        self.calls += 1
        if self.calls <= self.misses:
            raise LearnerUnavailable(f"learner at {self.endpoint} did not answer 'hello' within {timeout_s:.0f} s")
        return "reply"


def test_wait_for_learner_says_hello_again_until_the_learner_answers_and_gives_up_at_its_deadline():
    said = []
    slow = SlowLearner(misses=2)
    assert asyncio.run(wait_for_learner(slow, "hash", timeout_s=30, say=said.append)) == "reply"
    assert slow.calls == 3 and len(said) == 1 and "waiting for the learner" in said[0]
    gone = SlowLearner(misses=10**6)
    with pytest.raises(LearnerUnavailable, match="no learner answered at tcp://127.0.0.1:1 within 1 s"):
        asyncio.run(wait_for_learner(gone, "hash", timeout_s=1, say=said.append))
    assert gone.calls >= 2
