"""Reward functions with verl's signature: compute_score(data_source, solution_str, ground_truth, extra_info=None).

A user's own function plugs in through `reward.path` (a Python file) and `reward.function`. It may return a float
or a dict with a `score` key; the other numeric entries travel with the sample as `reward_info`. It may also be
an `async def`, which the generator awaits; a plain function runs in the reward worker processes
(generator/rewards/scorer.py), so it never blocks sampling.
"""
import asyncio
import inspect
import math
from typing import Callable, Optional

from asyncrl.generator.rewards.builtin import code_tests, gsm8k, math_answer, multiple_choice, reasoning_gym_score
from asyncrl.generator.rewards.client import score_remote
from asyncrl.generator.rewards.errors import RewardError
from asyncrl.generator.tasks import add_numbers, add_subtract, sort_digits, square_colour
from asyncrl.generator.user_code.loader import load_from_file

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo",
                "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                "numina_cn_k12", "numina_olympiads")
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
CHOICE_SOURCES = ("multiple_choice", "cais/mmlu", "allenai/ai2_arc", "Idavidrein/gpqa", "tau/commonsense_qa")
BUILTIN_REWARDS = {
    sort_digits.DATA_SOURCE: sort_digits.compute_score,
    add_numbers.DATA_SOURCE: add_numbers.compute_score,
    add_subtract.DATA_SOURCE: add_subtract.compute_score,
    square_colour.DATA_SOURCE: square_colour.compute_score,
    "openai/gsm8k": gsm8k.compute_score,
    **{source: math_answer.compute_score for source in MATH_SOURCES},
    **{source: code_tests.compute_score for source in CODE_SOURCES},
    **{source: multiple_choice.compute_score for source in CHOICE_SOURCES},
}
"""Built-in scorers by data_source, under the names verl's `default_compute_score` uses, so a verl parquet works
unchanged (plus the demo tasks, and hub names for multiple choice, which verl has no scorer for)."""
BUILTIN_PREFIXES = {"aime": math_answer.compute_score, reasoning_gym_score.PREFIX: reasoning_gym_score.compute_score}
"""data_source prefixes with a scorer (verl scores every "aime*" source as math; data.source=reasoning_gym rows are
"reasoning_gym/<task>", scored by the package's own verifiers)."""


def builtin_for(data_source: str) -> Callable | None:
    fn = BUILTIN_REWARDS.get(data_source)
    if fn is None:
        fn = next((f for prefix, f in BUILTIN_PREFIXES.items() if str(data_source).startswith(prefix)), None)
    return fn


def load_reward_fn(path: Optional[str], function: str) -> Callable:
    """The user's function from `path`, or a dispatcher over the built-in rewards by data_source."""
    if path is None:
        return builtin_reward
    try:
        fn = load_from_file(path, function, "reward.path")
    except FileNotFoundError as err:
        raise RewardError(str(err)) from None
    if not callable(fn):
        raise RewardError(f"reward.function {function!r} is not a function in {path}")
    return fn


def uses_builtin_rewards(reward_cfg) -> bool:
    """Whether some reward is a built-in scorer (no reward.path, or a reward.functions component with neither a path
    nor a server): then every data_source of the data needs one."""
    if reward_cfg.functions:
        return any(f.path is None and f.server is None for f in reward_cfg.functions)
    return reward_cfg.path is None


def check_builtin_rewards(data_sources) -> None:
    """Without reward.path every data_source of the dataset needs a built-in reward: say so at start, not when the
    first group of a missing one is scored."""
    missing = sorted(source for source in set(data_sources) if builtin_for(source) is None)
    if missing:
        raise RewardError(f"no built-in reward for data_source {', '.join(map(repr, missing))}; set reward.path and "
                          f"reward.function (built-ins: {sorted(BUILTIN_REWARDS)})")


def builtin_reward(data_source, solution_str, ground_truth, extra_info=None):
    fn = builtin_for(data_source)
    if fn is None:
        raise RewardError(
            f"no built-in reward for data_source {data_source!r}; set reward.path and reward.function "
            f"(built-ins: {sorted(BUILTIN_REWARDS)})"
        )
    return fn(data_source, solution_str, ground_truth, extra_info)


def score(fn: Callable, data_source: str, solution_str: str, ground_truth, extra_info) -> tuple[float, dict]:
    """Call the reward function and normalise its result to (reward, reward_info)."""
    return normalize_score(fn(data_source, solution_str, ground_truth, extra_info), data_source)


def build_reward_call(path: Optional[str], function: str) -> Callable:
    """What a reward worker process runs (generator/user_code/pool.py CallTarget): the user's function, loaded once
    in the worker, with its result normalised there (only two floats and a dict cross the pipe)."""
    fn = load_reward_fn(path, function)
    return lambda data_source, solution_str, ground_truth, extra_info: score(fn, data_source, solution_str,
                                                                               ground_truth, extra_info)


def build_combined_call(specs: tuple, timeout_s: float = 30.0) -> Callable:
    """What a reward worker runs with reward.functions: `specs` is ((name, weight, path, function, server), ...);
    each function is loaded once (path None: the built-in scorer; server: the reward server at that URL, asked
    about the prompt and the completion within `timeout_s`), and a call returns the weighted sum with each
    component in reward_info as `reward/<name>` (what the learner logs as `reward/<name>/mean`) and each
    function's own entries as `<name>/<key>`. A component that raises fails the whole call, naming it."""
    loaded = [(name, float(weight), server_reward(server, timeout_s) if server else load_reward_fn(path, function))
              for name, weight, path, function, server in specs]

    def call(data_source, solution_str, ground_truth, extra_info, prompt=None):
        total, info = 0.0, {}
        for name, weight, fn in loaded:
            try:
                result = (fn(data_source, solution_str, ground_truth, extra_info, prompt=prompt)
                          if isinstance(fn, RemoteReward) else fn(data_source, solution_str, ground_truth, extra_info))
                if inspect.isawaitable(result):  # an async def: this worker process has no loop of its own
                    result = asyncio.run(result)
                reward, extra = normalize_score(result, data_source)
            except Exception as err:
                raise RewardError(f"reward function {name!r}: {type(err).__name__}: {err}") from None
            total += weight * reward
            info[f"reward/{name}"] = reward
            info.update({f"{name}/{key}": value for key, value in extra.items()})
        return total, info

    return call


class RemoteReward:
    """A reward.functions component scored by a reward server (generator/reward_server/, asked through client.py):
    it also gets the prompt."""

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s

    def __call__(self, data_source, solution_str, ground_truth, extra_info, prompt=None) -> dict:
        score, info = score_remote(self.url, prompt, solution_str, data_source, ground_truth, self.timeout_s)
        return {"score": score, **info}


def server_reward(url: str, timeout_s: float) -> RemoteReward:
    return RemoteReward(url.rstrip("/"), timeout_s)


def normalize_score(result, data_source: str) -> tuple[float, dict]:
    """A float, or a dict with `score`, to (reward, reward_info); anything else, or a non-finite value, raises."""
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardError(f"reward function returned a dict without 'score': {sorted(result)}")
        reward = result["score"]
        info = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, (int, float, bool))}
    else:
        reward, info = result, {}
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise RewardError(f"reward function returned {type(reward).__name__}, not a number") from None
    if not math.isfinite(reward) or not all(math.isfinite(v) for v in info.values()):
        raise RewardError(f"reward function returned a non-finite value for data_source {data_source!r}")
    return reward, info


def overlong_penalty(length: int, max_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO overlong reward shaping (arXiv 2503.14476, eq. 13), added to the task reward.

    0 up to max_tokens - buffer_len tokens, then a linear ramp to -factor at max_tokens, and -factor beyond.
    Truncated answers are usually wrong for a reason the reward cannot see (they were cut), so a soft penalty
    teaches the policy to stop early instead of punishing a whole length band with noise. buffer_len = 0 is off.
    """
    if buffer_len <= 0:
        return 0.0
    expected = max_tokens - buffer_len
    if length <= expected:
        return 0.0
    if length <= max_tokens:
        return (expected - length) / buffer_len * factor
    return -factor
