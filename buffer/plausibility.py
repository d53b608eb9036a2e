"""Plausibility against the job: what this job's generators can produce, which every group must fit.

The codec (codec.py) checks that a message is a well-formed `Group`. That is not enough: a group can be well formed
and still poison training (a temperature of 0 divides the logits by zero; a reward of 1e300 is finite as a float64
and inf once stored as float32), crash it (an empty prompt), or stall it (87k one-token samples take seconds to
decode). A generator of this job samples with the recipe's settings, `rollout.n` completions of at most
`rollout.max_tokens` tokens, a prompt of at most `data.max_prompt_tokens`, inside the model's positions, so a group
that does not is rejected whole, with a reason, before it can reach a batch.

Two passes, both pure:
- `check_shape` runs on the unpacked msgpack structure before any sample is decoded: the sample count and every
  array's length come from byte lengths, so an oversized group costs the learner almost nothing.
- `check_values` runs on the decoded group: the sampling settings, rewards in float32 range, logprobs above the
  floor no engine can sample below, and no sample that says it stopped without a single token (an engine that
  stops emits its stop token; such samples beside real ones were trained, with advantages of their own).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
LOGPROB_FLOOR = -110.0
"""No engine samples a token less likely than this. The smallest positive float32 (a denormal, 1.4e-45) is
e^-103.3 and bfloat16's is larger, so a probability computed in any dtype an engine uses is either 0 (never sampled)
or has a logprob above -104; -110 leaves room for the engines' own rounding."""


@dataclass(frozen=True)
class JobLimits:
    """The bounds every group of this job fits (built from the recipe and the model by buffer/backends.py)."""

    group_size: int
    """rollout.n: samples per group."""
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    """rollout.*: the sampling every generator of the job uses (max_tokens: per model turn)."""
    max_completion_tokens: int
    """The most tokens after the prompt: rollout.max_tokens when single-turn, else the episode budget
    (RolloutConfig.completion_limit)."""
    max_prompt_tokens: int
    """data.max_prompt_tokens: generators skip longer prompts."""
    max_positions: int
    """The model's positions (max_position_embeddings): prompt + completion must fit."""
    max_turns: int = 1
    """rollout.max_turns when the job may send per-turn samples (rollout.turn_samples not `episode`, with
    episodes), else 1: the most samples one episode of a group becomes."""
    episodes: bool = False
    """Samples are multi-turn episodes (tools, an environment or an agent): a group's prompt is the episodes'
    shared opening, rendered by the environment, so it need not be the dealt row's tokens (buffer/dealing.py)."""
    routing: tuple | None = None
    """(num_layers, top_k, num_experts) of the model when the learner replays MoE routes (learner.moe_routing_replay):
    every sample must carry its routes in that shape. None: no sample may carry any."""
    forbidden_tokens: tuple = ()
    """Token ids no completion may hold: a vision-language model's placeholders (data/vision.py), which its engines
    never sample and its forward would take for images."""

    @property
    def max_samples(self) -> int:
        """The most samples a group holds: rollout.n, times max_turns with per-turn samples."""
        return self.group_size * self.max_turns


class Implausible(ValueError):
    """A group no generator of this job could have produced; `reason` is a codec REJECT_REASONS slug."""

    def __init__(self, reason: str, field: str, detail: str):
        super().__init__(f"{field}: {detail} [{reason}]")
        self.reason, self.field, self.detail = reason, field, detail


def check_shape(root: dict, limits: JobLimits) -> None:
    """Counts and lengths from the raw structure (before decoding). Fields of the wrong type are left to the codec,
    which names them."""
    samples = root.get("samples")
    per_turn = isinstance(samples, list) and any(isinstance(s, dict) and "episode" in s for s in samples)
    if per_turn and limits.max_turns == 1:
        raise Implausible("group_size", "samples", "per-turn samples (an `episode` index), but this job sends one "
                                                   "sample per episode (rollout.turn_samples, rollout.max_turns)")
    if isinstance(samples, list) and not per_turn and len(samples) != limits.group_size:
        raise Implausible("group_size", "samples", f"{len(samples)} samples, the job samples rollout.n="
                                                   f"{limits.group_size} per prompt")
    if per_turn and len(samples) > limits.max_samples:
        raise Implausible("group_size", "samples", f"{len(samples)} per-turn samples > rollout.n * rollout.max_turns"
                                                   f" = {limits.max_samples}")
    prompt = root.get("prompt_ids")
    prompt_len = len(prompt) // 4 if isinstance(prompt, bytes) else None
    if prompt_len is not None:
        if prompt_len == 0:
            raise Implausible("empty", "prompt_ids", "the prompt is empty")
        if prompt_len > limits.max_prompt_tokens:
            raise Implausible("too_long", "prompt_ids", f"{prompt_len} tokens > data.max_prompt_tokens="
                                                        f"{limits.max_prompt_tokens}")
    for i, sample in enumerate(samples if isinstance(samples, list) else []):
        ids = sample.get("completion_ids") if isinstance(sample, dict) else None
        if not isinstance(ids, bytes):
            continue
        length = len(ids) // 4
        if length > limits.max_completion_tokens:
            raise Implausible("too_long", f"samples[{i}].completion_ids", f"{length} tokens > the job's "
                                                                         f"{limits.max_completion_tokens} per sample")
        if prompt_len is not None and prompt_len + length > limits.max_positions:
            raise Implausible("too_long", f"samples[{i}]", f"prompt + completion = {prompt_len + length} tokens > the "
                                                          f"model's {limits.max_positions} positions")


def check_values(group, limits: JobLimits) -> None:
    """The decoded group's sampling, rewards and logprobs against what a generator of this job produces."""
    sampling = group.sampling
    expected = (limits.temperature, limits.top_p, limits.top_k, limits.max_tokens)
    got = (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens)
    if got != expected:
        raise Implausible("sampling", "sampling", f"(temperature, top_p, top_k, max_tokens) = {got}, the recipe's "
                                                  f"rollout section says {expected}")
    for i, sample in enumerate(group.samples):
        problem = reward_problem(sample.reward)
        if problem is not None:
            raise Implausible("bad_reward", f"samples[{i}].reward", problem)
        for key, value in sample.reward_info.items():
            problem = reward_problem(value)
            if problem is not None:
                raise Implausible("bad_reward", f"samples[{i}].reward_info[{key!r}]", problem)
        if sample.finish_reason == "stop" and len(sample.completion_ids) == 0:
            raise Implausible("bad_finish_reason", f"samples[{i}]", "no completion token, yet finish_reason 'stop': "
                                                                    "an engine that stops emits its stop token")
        if limits.forbidden_tokens:
            held = np.isin(sample.completion_ids, limits.forbidden_tokens)
            if held.any():
                index = int(np.flatnonzero(held)[0])
                raise Implausible("token_out_of_range", f"samples[{i}].completion_ids",
                                  f"[{index}]={sample.completion_ids[index]} is a vision placeholder token, which no "
                                  f"engine of this job samples")
        low = sample.logprobs < LOGPROB_FLOOR
        if low.any():
            index = int(np.flatnonzero(low)[0])
            raise Implausible("bad_logprob", f"samples[{i}].logprobs", f"[{index}]={sample.logprobs[index]} is below "
                                                                       f"{LOGPROB_FLOOR}, which no engine samples")
    check_turns(group.samples, limits)
    baseline = group.meta.get("baseline_reward")
    if isinstance(baseline, (int, float)) and reward_problem(baseline) is not None:
        raise Implausible("bad_reward", "meta['baseline_reward']", reward_problem(baseline))


def reward_problem(reward) -> str | None:
    """Why `reward` is not a reward this job trains on or reports (None: it is): a number (not a bool), finite, and
    within float32, the dtype rewards are trained in (1e300 is finite as a float64 and inf once stored as float32;
    two of 1e308 make a float64 mean inf). Training groups and evaluation results (buffer/eval_rounds.py) are
    checked by this one function, so the two can never disagree on what a generator may report."""
    if type(reward) not in (int, float) and not isinstance(reward, np.floating):
        return f"{str(reward)[:40]!r} is not a number"
    if not np.isfinite(reward):
        return f"{reward} is not finite"
    if abs(reward) > FLOAT32_MAX:
        return f"{reward} overflows float32, the dtype rewards are trained in"
    return None


def check_turns(samples: list, limits: JobLimits) -> None:
    """Per-turn samples (the codec checked they name episodes 0, 1, ...): exactly rollout.n episodes, each of at
    most rollout.max_turns turns that share one reward (the episode's, which is what the advantage is of)."""
    if not samples or samples[0].episode is None:
        return
    rewards, turns = {}, {}
    for i, sample in enumerate(samples):
        turns[sample.episode] = turns.get(sample.episode, 0) + 1
        if rewards.setdefault(sample.episode, sample.reward) != sample.reward:
            raise Implausible("bad_reward", f"samples[{i}].reward", f"{sample.reward} != {rewards[sample.episode]}, "
                                                                   f"the reward of episode {sample.episode}'s other "
                                                                   f"turns")
    if len(turns) != limits.group_size:
        raise Implausible("group_size", "samples[].episode", f"{len(turns)} episodes, the job samples rollout.n="
                                                             f"{limits.group_size} per prompt")
    longest = max(turns, key=turns.get)
    if turns[longest] > limits.max_turns:
        raise Implausible("group_size", "samples[].episode", f"episode {longest} has {turns[longest]} turns > "
                                                             f"rollout.max_turns={limits.max_turns}")


MAX_STAT_KEYS = 256
MAX_STAT_KEY_CHARS = 200


def check_stats(metrics) -> str | None:
    """Why a generator's stats report is not usable data (None: it is): a map of at most MAX_STAT_KEYS metric names
    (strings) to finite numbers. The learner sums and logs these, so a string or an inf there would crash or
    poison what it reports."""
    if not isinstance(metrics, dict):
        return f"expected a map, got {type(metrics).__name__}"
    if len(metrics) > MAX_STAT_KEYS:
        return f"{len(metrics)} metrics > {MAX_STAT_KEYS}"
    for key, value in metrics.items():
        if not isinstance(key, str) or not key or len(key) > MAX_STAT_KEY_CHARS:
            return f"metric name {str(key)[:40]!r} is not a string of 1 to {MAX_STAT_KEY_CHARS} characters"
        if type(value) not in (int, float) or not np.isfinite(value) or abs(value) > FLOAT32_MAX:
            return f"metric {key!r} = {str(value)[:40]!r} is not a finite number"
    return None


MAX_ADMIT_WANT = 1 << 20
"""The most admissions one admit request may ask for: far more than any generator runs rollouts at once."""


def check_admit(want, version) -> str | None:
    """Why an admit request's fields are malformed (None: they are well formed): `want` must be an integer in
    [1, MAX_ADMIT_WANT], and `version` (the engine's weight version, which pins the evaluation rounds it is dealt)
    absent (None) or an integer >= 0. Nothing is coerced: a generator that asks for -5, "all" or 1e9 admissions, or
    says it holds v-7, is broken or hostile, and reading that as "1" or "v0" granted it deals and evaluation
    prompts it could not have asked for."""
    if type(want) is not int or not 1 <= want <= MAX_ADMIT_WANT:
        return f"admit: 'want' must be an integer in [1, {MAX_ADMIT_WANT}], got {str(want)[:40]!r}"
    if version is not None and (type(version) is not int or version < 0):
        return (f"admit: 'ver' (the version the engine holds) must be absent or an integer >= 0, got "
                f"{str(version)[:40]!r}")
    return None
