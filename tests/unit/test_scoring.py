"""The reward worker pool (generator/user_code/pool.py) and the scorer on top of it (generator/rewards/scorer.py),
with real spawned worker processes: a hung call is killed at its timeout, a dying worker fails only its call, a
cancelled call never answers the next caller, the loop keeps running meanwhile, and every failure scores 0, counted."""
import asyncio
import os
import time

import pytest

from asyncrl.generator.rewards.scorer import RewardScorer
from asyncrl.generator.user_code.pool import CallFailed, CallTarget, CallTimeout, ProcessCallPool

REWARD_FILE = '''
import os, time

def judge(data_source, solution_str, ground_truth, extra_info=None):
    """The solution says what to do: hang, die, raise, nan, sleep:<s>, or anything else (scored by its length)."""
    if solution_str == "hang":
        while True:
            pass
    if solution_str == "die":
        os._exit(3)
    if solution_str == "raise":
        raise ValueError("the judge is broken")
    if solution_str == "nan":
        return float("nan")
    if solution_str.startswith("sleep:"):
        time.sleep(float(solution_str[6:]))
        return {"score": 1.0, "slept": float(solution_str[6:])}
    if solution_str == "pid":
        return float(os.getpid())
    if solution_str == "print":
        print("noise " * 10000)  # must not corrupt the worker's answers (they travel on stdout's original fd)
        os.write(1, b"raw noise")
        return 5.0
    return float(len(solution_str))


async def judge_async(data_source, solution_str, ground_truth, extra_info=None):
    import asyncio
    if solution_str.startswith("sleep:"):
        await asyncio.sleep(float(solution_str[6:]))
    if solution_str == "raise":
        raise ValueError("the async judge is broken")
    return float(len(solution_str))
'''


@pytest.fixture()
def reward_path(tmp_path):
    path = tmp_path / "judge.py"
    path.write_text(REWARD_FILE)
    return str(path)


def make_pool(reward_path, workers=2, timeout_s=2.0):
    return ProcessCallPool(CallTarget("asyncrl.generator.rewards.functions:build_reward_call", (reward_path, "judge")),
                           workers=workers, timeout_s=timeout_s, name="test-pool")


def call(pool, text, **kwargs):
    return pool.call("src", text, "gt", None, **kwargs)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a killed child not yet reaped is a zombie: dead for our purposes
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def wait_until(condition, timeout_s=5.0):
    """Workers are killed and replaced in the background: the caller that gave up on one does not wait."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.02)


def test_a_hung_call_is_killed_at_its_timeout_and_the_pool_serves_on(reward_path):
    async def scenario():
        pool = make_pool(reward_path, workers=1, timeout_s=1.5)
        await pool.start()
        try:
            assert await call(pool, "abcd") == (4.0, {})  # also waits out the worker's start
            hung_pid = int((await call(pool, "pid"))[0])
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            ticking = asyncio.create_task(ticker())
            started = time.monotonic()
            with pytest.raises(CallTimeout, match="1.5 s"):
                await call(pool, "hang")
            waited = time.monotonic() - started
            ticking.cancel()
            assert 1.4 < waited < 4.0
            assert ticks >= 20  # the loop ran all along: the spinning call is in another process
            await wait_until(lambda: not alive(hung_pid) and pool.replaced == 1)
            assert await call(pool, "ab") == (2.0, {})  # a fresh worker answers
            assert int((await call(pool, "pid"))[0]) != hung_pid
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_dying_worker_or_a_raising_call_fails_only_that_call(reward_path):
    async def scenario():
        pool = make_pool(reward_path, workers=1)
        await pool.start()
        try:
            with pytest.raises(CallFailed, match="exit code 3") as died:
                await call(pool, "die")
            assert died.value.kind == "WorkerDied"
            with pytest.raises(CallFailed, match="the judge is broken") as raised:
                await call(pool, "raise")
            assert raised.value.kind == "ValueError"
            with pytest.raises(CallFailed, match="non-finite") as bad:
                await call(pool, "nan")
            assert bad.value.kind == "RewardError"
            assert await call(pool, "print") == (5.0, {})
            assert await call(pool, "abc") == (3.0, {})
            assert pool.replaced == 1  # only the dead one; an exception leaves its worker serving
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_workers_that_die_before_answering_break_the_pool_instead_of_respawning_forever():
    from asyncrl.generator.user_code.pool import PoolBroken

    async def scenario():
        pool = ProcessCallPool(CallTarget("os:_exit", (1,)), workers=1, timeout_s=5.0, name="doomed")
        await pool.start()
        try:
            for _ in range(3):
                with pytest.raises(CallFailed, match="exit code 1"):
                    await pool.call()
            with pytest.raises(PoolBroken, match="3 workers in a row died"):
                await pool.call()
            return pool.replaced
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == 2  # the third death broke it: no fourth worker was started


def test_a_cancelled_call_never_answers_the_next_caller(reward_path):
    """Without replacing the worker, the next caller would read the cancelled call's late answer (1.0)."""
    async def scenario():
        pool = make_pool(reward_path, workers=1)
        await pool.start()
        try:
            await call(pool, "warm")
            task = asyncio.create_task(call(pool, "sleep:0.5"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await call(pool, "abcdefg") == (7.0, {})
            assert pool.replaced == 1
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_the_pool_is_bounded_and_runs_its_workers_in_parallel(reward_path):
    async def scenario():
        pool = make_pool(reward_path, workers=2)
        await pool.start()
        try:
            await asyncio.gather(call(pool, "warm"), call(pool, "warm"))
            started = time.monotonic()
            results = await asyncio.gather(*(call(pool, "sleep:0.4") for _ in range(4)))
            elapsed, pids = time.monotonic() - started, pool.pids()
            await pool.close()
            return elapsed, results, pids
        finally:
            await pool.close()

    elapsed, results, pids = asyncio.run(scenario())
    assert results == [(1.0, {"slept": 0.4})] * 4
    assert 0.75 < elapsed < 1.6  # 4 calls of 0.4 s on 2 workers: two rounds, not one and not four
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)  # close() killed them


def test_the_scorer_scores_failures_zero_and_counts_them_by_reason(reward_path, caplog):
    async def scenario():
        scorer = RewardScorer(reward_path, "judge", workers=2, timeout_s=3.0, source="generator g")
        await scorer.start()
        try:
            texts = ["abc", "raise", "nan", "hang", "die", "raise", "xy"]
            return await asyncio.gather(*(scorer.score("src", text, "gt", None, prompt_id=f"p{index}")
                                          for index, text in enumerate(texts))), scorer.error_counts()
        finally:
            await scorer.close()

    scores, errors = asyncio.run(scenario())
    assert [reward for reward, _ in scores] == [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]
    assert scores[1][1] == {"reward_error": 1.0} and scores[0][1] == {}
    assert errors == {"error": 3, "bad_value": 1, "timeout": 1}  # raise ×2 and the dead worker; nan; hang
    assert "generator g: scored 0 for its reward from prompt p3 (timeout)" in caplog.text


def test_an_async_reward_function_is_awaited_under_the_timeout(reward_path):
    async def scenario():
        scorer = RewardScorer(reward_path, "judge_async", workers=1, timeout_s=0.5)
        await scorer.start()
        assert scorer.pool is None  # no processes for a coroutine
        results = await asyncio.gather(*(scorer.score("src", text, "gt", None)
                                         for text in ("sleep:0.1", "sleep:5", "raise", "abcd")))
        return results, scorer.error_counts()

    started = time.monotonic()
    results, errors = asyncio.run(scenario())
    assert time.monotonic() - started < 2.0
    assert [reward for reward, _ in results] == [9.0, 0.0, 0.0, 4.0]
    assert errors == {"timeout": 1, "error": 1}


def test_a_missing_reward_file_or_function_fails_before_any_sampling(reward_path, tmp_path):
    from asyncrl.generator.rewards.errors import RewardError
    from asyncrl.generator.rewards.functions import check_builtin_rewards

    with pytest.raises(RewardError, match="does not exist"):
        RewardScorer(str(tmp_path / "absent.py"), "judge", workers=1, timeout_s=1.0)
    with pytest.raises(RewardError, match="nope"):
        RewardScorer(reward_path, "nope", workers=1, timeout_s=1.0)
    check_builtin_rewards({"asyncrl/sort_digits"})
    with pytest.raises(RewardError, match="'my/own_dataset'"):
        check_builtin_rewards({"asyncrl/sort_digits", "my/own_dataset"})


def test_several_named_weighted_functions_sum_with_each_component_in_reward_info(reward_path):
    """reward.functions: the built-in GSM8K scorer and two of the user's (one async), in real worker processes."""
    from asyncrl.configs.sections import RewardFunction

    functions = [RewardFunction("correct", 1.0), RewardFunction("length", 0.1, reward_path, "judge"),
                 RewardFunction("async_len", -0.5, reward_path, "judge_async")]

    async def scenario():
        scorer = RewardScorer(None, "compute_score", workers=1, timeout_s=10.0, functions=functions)
        await scorer.start()
        try:
            good = await scorer.score("openai/gsm8k", "#### 72", "72", None)
            broken = await scorer.score("openai/gsm8k", "raise", "72", None)
            return good, broken, scorer.error_counts()
        finally:
            await scorer.close()

    (reward, info), broken, errors = asyncio.run(scenario())
    assert info["reward/correct"] == 1.0 and info["reward/length"] == 7.0 and info["reward/async_len"] == 7.0
    assert info["correct/answer_found"] == 1.0
    assert reward == pytest.approx(1.0 + 0.1 * 7.0 - 0.5 * 7.0)
    assert broken == (0.0, {"reward_error": 1.0}) and errors == {"bad_value": 1}  # a component failed: the sample


def test_reward_functions_are_checked_when_the_config_loads(tmp_path):
    from asyncrl.configs import ConfigError, load_config

    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(None, ["reward.functions=[{name: a}, {name: a}]"])
    with pytest.raises(ConfigError, match="each needs a name"):
        load_config(None, ["reward.functions=[{name: 'has space'}]"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["reward.functions=[{name: a}]", "reward.path=r.py"])
    with pytest.raises(ConfigError, match="weight must be finite"):
        load_config(None, ["reward.functions=[{name: a, weight: .inf}]"])
    from asyncrl.configs.sections import RewardFunction
    from asyncrl.generator.rewards.errors import RewardError

    with pytest.raises(RewardError, match="absent.py"):  # before any worker starts
        RewardScorer(None, "compute_score", 1, 1.0, functions=[RewardFunction("a", 1.0, str(tmp_path / "absent.py"))])
