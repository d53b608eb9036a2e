"""The reward server's logic (generator/reward_server/): batching across requests with bounded memory and
deadlines, request validation, the judge's prompt and verdict, and the client's reading of replies. The real
server, models and generator pool are in tests/integration/test_reward_server.py."""
import asyncio

import pytest

from asyncrl.configs import ConfigError, load_config
from asyncrl.generator.reward_server.batcher import Batcher, QueueFull, ScoreTimeout
from asyncrl.generator.reward_server.items import BadItem, ScoreItem, parse_items
from asyncrl.generator.reward_server.judge import judge_message, parse_verdict
from asyncrl.generator.rewards.client import read_reply
from asyncrl.generator.rewards.errors import RewardError
from asyncrl.generator.rewards.functions import uses_builtin_rewards


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


class Model:
    """Scores an item by its response's length; records each batch; `gate` holds batches until set."""

    def __init__(self, fail_on=None):
        self.batches, self.fail_on = [], fail_on
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, items):
        await self.gate.wait()
        self.batches.append(len(items))
        if any(item == self.fail_on for item in items):
            raise ValueError("the model broke")
        return [(float(len(item)), {}) for item in items]


def test_concurrent_requests_are_scored_in_one_batch_in_order():
    model = Model()

    async def scenario():
        batcher = Batcher(model, max_batch=16, batch_wait_s=0.05, max_queue=64, timeout_s=5)
        batcher.start()
        results = await asyncio.gather(*(batcher.score(["x" * i]) for i in range(10)), batcher.score(["ab", "abc"]))
        await batcher.close()
        return results, batcher.stats()

    results, stats = run(scenario())
    assert [r[0][0] for r in results[:10]] == [float(i) for i in range(10)] and results[10] == [(2.0, {}), (3.0, {})]
    assert model.batches == [12] and stats["mean_batch"] == 12


def test_a_full_queue_refuses_at_once_and_a_slow_model_times_requests_out():
    model = Model()
    model.gate.clear()  # the model is stuck: items pile up

    async def scenario():
        batcher = Batcher(model, max_batch=2, batch_wait_s=0.0, max_queue=3, timeout_s=0.3)
        batcher.start()
        waiting = [asyncio.create_task(batcher.score(["a"])) for _ in range(2)]
        await asyncio.sleep(0.02)  # these two are the stuck batch
        waiting += [asyncio.create_task(batcher.score(["a"])) for _ in range(3)]
        await asyncio.sleep(0.02)  # these three fill the queue
        with pytest.raises(QueueFull):
            await batcher.score(["b"])
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        model.gate.set()
        later = await batcher.score(["ok"])  # the timed-out items were skipped, the server goes on
        await batcher.close()
        return outcomes, later, batcher.stats()

    outcomes, later, stats = run(scenario())
    assert all(isinstance(o, ScoreTimeout) for o in outcomes) and later == [(2.0, {})]
    assert stats["refused_full"] == 1 and stats["timeouts"] == 5 and model.batches[-1] == 1


def test_a_batch_the_model_fails_on_fails_its_requests_only():
    model = Model(fail_on="bad")

    async def scenario():
        batcher = Batcher(model, max_batch=8, batch_wait_s=0.02, max_queue=8, timeout_s=5)
        batcher.start()
        first = await asyncio.gather(batcher.score(["bad"]), batcher.score(["x"]), return_exceptions=True)
        second = await batcher.score(["fine"])
        await batcher.close()
        return first, second

    first, second = run(scenario())
    assert all("the model broke" in str(o) for o in first) and second == [(4.0, {})]


def test_requests_are_checked_at_the_door():
    items = parse_items({"items": [{"prompt": "q", "response": "a", "ground_truth": [1]},
                                   {"prompt": [{"role": "user", "content": "q2"}], "response": "b",
                                    "data_source": "s"}]}, max_items=8)
    assert items[0].prompt == [{"role": "user", "content": "q"}] and items[1].data_source == "s"
    for body in ({}, {"items": []}, {"items": [1]}, {"items": [{"prompt": 3, "response": "a"}]},
                 {"items": [{"prompt": "q", "response": None}]}, {"items": [{"prompt": "q", "response": "a"}] * 9},
                 {"items": [{"prompt": [{"role": "user"}], "response": "a"}]},
                 {"items": [{"prompt": "q", "response": "a" * (1 << 21)}]}, [1, 2]):
        with pytest.raises(BadItem):
            parse_items(body, max_items=8)


def test_the_judge_asks_the_template_and_reads_the_first_number():
    item = ScoreItem([{"role": "system", "content": "s"}, {"role": "user", "content": "What is {x}?"}], "42",
                     "openai/gsm8k", 42)
    assert judge_message("Q: {prompt} A: {response} R: {ground_truth} ({data_source})", item) == \
        "Q: What is {x}? A: 42 R: 42 (openai/gsm8k)"
    assert parse_verdict("Score: 7/10", r"(\d+)", 0.1, 0.0) == (pytest.approx(0.7), True)
    assert parse_verdict("no idea", r"(\d+)", 0.1, -1.0) == (-1.0, False)
    assert parse_verdict("9" * 400, r"(\d+)", 1.0, 0.0) == (0.0, False)  # inf is no score


def test_a_reply_that_is_not_a_score_is_the_servers_fault():
    assert read_reply("u", {"scores": [0.5], "info": [{"judge_parsed": 1}]}) == (0.5, {"judge_parsed": 1.0})
    for body in ({}, {"scores": []}, {"scores": ["x"]}, {"scores": [float("nan")]}, {"scores": [1], "info": [3]}):
        with pytest.raises(RewardError, match="reward server u"):
            read_reply("u", body)


def test_reward_server_settings_are_checked():
    cfg = load_config(None, ["reward.functions=[{name: rm, server: 'http://127.0.0.1:8700'}]"])
    assert not uses_builtin_rewards(cfg.reward)
    assert uses_builtin_rewards(load_config(None, ["reward.functions=[{name: a}, {name: rm, server: 'http://x'}]"]).reward)
    for bad in ("reward_server.kind=oracle", "reward_server.score_pattern=\\d+", "reward_server.score_pattern=(",
                "reward_server.max_queue=0", "reward.functions=[{name: rm, server: 'ftp://x'}]",
                "reward.functions=[{name: rm, server: 'http://x', path: r.py}]"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])
