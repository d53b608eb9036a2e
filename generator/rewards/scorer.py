"""Scoring completions without ever blocking the generator's event loop.

A plain reward function runs in a `ProcessCallPool` (generator/user_code/pool.py): one call per sample, each under
`reward.timeout_s`; a hung call has its worker killed. An `async def` reward function is awaited under the same
timeout (it is the user's promise not to block; a coroutine cannot be killed, only abandoned). Either way a call
that raises, returns something that is not a finite score, or times out scores 0, is counted by reason in
`generator/reward_errors/<reason>` and logged (the first of each reason, then one line per 10 s), and the
generator keeps sampling. A pool whose workers cannot even start (`PoolBroken`) stops the generator. Only a configuration error is fatal, and it is found before sampling starts (a missing
reward file or function: `load_reward_fn`; a data_source without a built-in reward: `check_builtin_rewards`).
"""
import asyncio
import inspect
import logging
import time
from typing import Optional

from asyncrl.telemetry.rejections import RejectionLog
from asyncrl.generator.rewards.functions import load_reward_fn, normalize_score
from asyncrl.generator.user_code.pool import CallFailed, CallTarget, CallTimeout, PoolBroken, ProcessCallPool

log = logging.getLogger(__name__)
FAILED_INFO = {"reward_error": 1.0}
"""The reward_info of a sample whose reward call failed (it scores 0)."""


class RewardScorer:
    """`await score(data_source, text, ground_truth, extra_info)` -> (reward, reward_info), never raising for what
    the reward function did. `seconds` accumulates the wall time of reward calls (`timing/reward_s`)."""

    def __init__(self, path: Optional[str], function: str, workers: int, timeout_s: float, source: str = "generator",
                 functions=()):
        """`functions`: reward.functions (named, weighted components, all run in the worker pool, an async one
        on the worker's own loop); empty: `path` and `function` alone."""
        specs = tuple((f.name, f.weight, f.path, f.function, f.server) for f in functions)
        for _, _, fn_path, fn_name, server in specs or ((None, None, path, function, None),):
            fn = None if server else load_reward_fn(fn_path, fn_name)  # a missing one fails here, before sampling
        self.timeout_s = timeout_s
        self.specs = specs
        self.servers = sorted({server for *_, server in specs if server})
        self.async_fn = fn if not specs and inspect.iscoroutinefunction(fn) else None
        factories = "asyncrl.generator.rewards.functions"
        target = (CallTarget(f"{factories}:build_combined_call", (specs, timeout_s)) if specs else
                  CallTarget(f"{factories}:build_reward_call", (path, function)))
        self.pool = None if self.async_fn else ProcessCallPool(target, workers, timeout_s, name="asyncrl-reward")
        self.failures = RejectionLog(log, "its reward", area=source, verb="scored 0 for")
        self.seconds = 0.0
        self.calls = 0

    async def start(self) -> None:
        if self.pool is not None:
            await self.pool.start()

    async def score(self, data_source: str, text: str, ground_truth, extra_info, prompt_id: str = "?",
                    prompt: list | None = None) -> tuple[float, dict]:
        """`prompt`: the row's chat messages, for reward.functions components scored by a reward server."""
        started = time.monotonic()
        try:
            if self.async_fn is not None:
                result = await asyncio.wait_for(self.async_fn(data_source, text, ground_truth, extra_info),
                                                self.timeout_s)
                return normalize_score(result, data_source)
            if self.specs:
                return await self.pool.call(data_source, text, ground_truth, extra_info, prompt)
            return await self.pool.call(data_source, text, ground_truth, extra_info)
        except PoolBroken:
            raise  # not this call's fault: the generator stops and says why
        except (CallTimeout, asyncio.TimeoutError):
            self.failures.reject("timeout", f"prompt {prompt_id}", f"no score within {self.timeout_s:g} s")
        except CallFailed as err:
            self.failures.reject("bad_value" if err.kind == "RewardError" else "error", f"prompt {prompt_id}",
                                 str(err))
        except Exception as err:  # an async reward function's own exception
            self.failures.reject("bad_value" if type(err).__name__ == "RewardError" else "error",
                                 f"prompt {prompt_id}", f"{type(err).__name__}: {err}")
        finally:
            self.seconds += time.monotonic() - started
            self.calls += 1
        return 0.0, dict(FAILED_INFO)

    def error_counts(self) -> dict:
        """reason -> failed calls so far."""
        return self.failures.snapshot()

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
