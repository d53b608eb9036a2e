"""A slow reward function never stalls the fleet: with a reward that sleeps 5 s on one prompt in ten, the other
groups keep reaching the learner at close to the rate of a run without the slow ones.

Real parts: the zmq buffer server and client, the rollout loop, and the reward worker processes
(generator/rewards/scorer.py). The engine is a fake that decodes one group at a time in 0.1 s, so the fast rate
is set by the engine (about 10 groups/s), not by this machine's two cores."""
import asyncio
import time

from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.client import ZmqBufferClient
from asyncrl.buffer.zmq.server import ZmqBufferServer
from asyncrl.configs.sections import RewardConfig
from asyncrl.generator.config import RolloutConfig
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.engines.base import Completion
from asyncrl.generator.rollout import RolloutLoop
from asyncrl.generator.rewards.scorer import RewardScorer
from tests.conftest import free_port
from tests.messages import run_info

REWARD = '''
import time

def judge(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info.get("slow"):
        time.sleep(5.0)
    return float(solution_str == ground_truth)
'''


class OneAtATimeEngine:
    """A device that decodes one group at a time, 0.1 s each; answers "9" and "7" alternately."""

    version = 0
    resumed_requests = 0

    def __init__(self):
        self.device = asyncio.Lock()

    async def sample(self, prompt_ids, sampling, n):
        async with self.device:
            await asyncio.sleep(0.1)
        return [Completion(token_ids=[9 if i % 2 else 7], logprobs=[-0.5], versions=[0], finish_reason="stop")
                for i in range(n)]


class DigitTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def fast_group_rate(reward_path: str, slow_every: int, seconds: float) -> tuple[float, int, dict]:
    """Groups of fast prompts that reached the learner per second over `seconds`, the slow groups that did, and
    the scorer's mean seconds per call and its failures."""
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(0, 100_000), vocab_size=16, config_hash="h",
                             max_message_bytes=1 << 16, queue_groups=10_000, run_info=run_info())
    server.start()
    client = ZmqBufferClient(server.endpoint, "g", timeout_s=5)
    rows = (PromptRow(prompt_id=f"p{i}", prompt_ids=[1, 2], data_source="t", ground_truth="9",
                      extra_info={"slow": slow_every > 0 and i % slow_every == 0}) for i in range(100_000))
    scorer = RewardScorer(reward_path, "judge", workers=16, timeout_s=30.0)
    loop = RolloutLoop(client=client, engine=OneAtATimeEngine(), prompts=rows, scorer=scorer,
                       tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(n=2, max_tokens=4),
                       max_inflight_groups=16, generator_id="g", reward_shaping=RewardConfig(), stats_every_s=3600)

    async def scenario():
        await scorer.start()
        try:
            await asyncio.gather(*(scorer.score("t", "warm", "9", {}) for _ in range(16)))  # the workers are up
            scorer.seconds, scorer.calls = 0.0, 0
            task = asyncio.create_task(loop.run())
            await asyncio.sleep(seconds)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            await scorer.close()

    try:
        asyncio.run(scenario())
        fast = slow = 0
        while (group := server.take(0.05)) is not None:
            if slow_every and int(group.prompt_id[1:]) % slow_every == 0:
                slow += 1
            else:
                fast += 1
        return fast / seconds, slow, (scorer.seconds / scorer.calls, scorer.error_counts())
    finally:
        client.close()
        server.close()


def test_a_reward_that_sleeps_5_s_on_one_prompt_in_ten_does_not_slow_the_other_groups(tmp_path):
    path = tmp_path / "slow_judge.py"
    path.write_text(REWARD)
    fast_rate, _, (fast_call_s, _) = fast_group_rate(str(path), slow_every=0, seconds=4.0)
    started = time.monotonic()
    mixed_rate, slow_groups, (mixed_call_s, errors) = fast_group_rate(str(path), slow_every=10, seconds=8.0)
    assert time.monotonic() - started < 20
    print(f"fast prompts' groups/s: {fast_rate:.1f} alone, {mixed_rate:.1f} beside slow rewards "
          f"({slow_groups} slow groups arrived)")
    assert fast_rate > 5  # the engine's pace (10/s), less the start
    # the slow prompts take a tenth of the engine's time, so 0.9 of the fast rate is the ideal; a reward that ran on
    # the event loop would have stopped everything for 5 s once a second
    assert mixed_rate > 0.8 * fast_rate
    assert slow_groups >= 3  # the slow ones arrive too, 5 s late, scored
    assert mixed_call_s > 10 * fast_call_s and errors == {}
