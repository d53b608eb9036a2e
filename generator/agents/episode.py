"""Running one multi-turn episode, and turning a prompt's n episodes into the samples of one `Group`.

Contract of `EpisodeRunner.run(row, sampling)`: the environment's reset gives the opening messages, rendered
once into the prompt; then, until a budget or the environment ends it, the engine samples a model turn from the
whole sequence so far, the environment steps on that turn's text, and its messages are appended as ids
(chat_render.py). The tokens sent to the engine at turn k are exactly turn k-1's, plus what turn k-1 sampled,
plus the appended ids: nothing is re-tokenized. It waits on the engine and on the environment (each reset and
step under `step_timeout_s`); it never raises for what the environment does (`env_error` ends the episode).

Budgets, and the finish reason each gives: a model turn that hits rollout.max_tokens (`length`), the engine's
abort (`abort`), rollout.max_turns model turns (`max_turns`), rollout.max_episode_tokens or the model's positions
(`max_episode_tokens`); an environment that says done (`stop`).
"""
import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from asyncrl.buffer.group import Sample
from asyncrl.generator.agents.chat_render import TemplateCannotAppend
from asyncrl.generator.agents.environment import StepResult, messages_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeBudget:
    max_turns: int
    """rollout.max_turns: model turns per episode."""
    max_episode_tokens: int
    """rollout.max_episode_tokens: tokens after the prompt (0: only the positions bound)."""
    max_model_len: int
    """generator.max_model_len: prompt plus everything after it."""
    max_prompt_tokens: int
    """data.max_prompt_tokens: an episode whose rendered opening is longer is refused (the learner would be)."""


class PromptTooLong(ValueError):
    """The episode's opening, rendered with the tools, is longer than data.max_prompt_tokens."""


@dataclass
class Episode:
    prompt_len: int
    sequence: list = field(default_factory=list)  # the prompt and everything after it
    logprobs: list = field(default_factory=list)  # per token after the prompt; 0.0 on environment tokens
    versions: list = field(default_factory=list)  # per token after the prompt; -1 on environment tokens until done
    loss_mask: list = field(default_factory=list)  # 1 on model tokens, 0 on environment tokens
    finish_reason: str = "stop"
    turns: int = 0  # model turns sampled
    tool_calls: int = 0
    env_tokens: int = 0
    rewards: list = field(default_factory=list)  # the environment's step rewards (None ones left out)
    info: dict = field(default_factory=dict)
    last_text: str = ""  # the last model turn, decoded: what the reward function scores
    env_error: str = ""  # why the environment ended it ("" if it did not fail)

    def after_prompt(self) -> int:
        return len(self.sequence) - self.prompt_len

    def add_model_turn(self, completion, room: int, tokenizer) -> None:
        """Append what the engine sampled (loss_mask 1), cut to `room` tokens; the finish reason becomes the
        engine's, or max_episode_tokens when it was cut."""
        ids = list(completion.token_ids)[:room]
        self.sequence += ids
        self.logprobs += list(completion.logprobs)[:room]
        self.versions += list(completion.versions)[:room]
        self.loss_mask += [1] * len(ids)
        self.turns += 1
        self.last_text = tokenizer.decode(ids, skip_special_tokens=True)
        self.finish_reason = "max_episode_tokens" if len(ids) < len(completion.token_ids) else \
            completion.finish_reason

    def add_env_turn(self, ids: list) -> None:
        """Append an environment turn's ids (loss_mask 0, no logprob, a version set when the group is built)."""
        self.sequence += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.env_tokens += len(ids)


class EpisodeRunner:
    """Runs episodes against `make_env()` (a fresh environment per episode) on `engine`."""

    def __init__(self, engine, tokenizer, appender, make_env: Callable, budget: EpisodeBudget, step_timeout_s: float,
                 toolbox=None):
        self.engine, self.tokenizer, self.appender = engine, tokenizer, appender
        self.make_env, self.budget, self.step_timeout_s = make_env, budget, step_timeout_s
        self.toolbox = toolbox  # tools.py ToolBox when the environment is the tool environment: its metrics
        self.env_errors: Counter = Counter()

    async def start(self) -> None:
        """The tools' worker processes and MCP servers (before any episode runs)."""
        if self.toolbox is not None:
            await self.toolbox.start()

    async def close(self) -> None:
        if self.toolbox is not None:
            await self.toolbox.close()

    def metrics(self) -> dict:
        """Environment failures by reason and the tools' errors and call times, so far."""
        return {**{f"rollout/env_errors/{reason}": float(count) for reason, count in sorted(self.env_errors.items())},
                **(self.toolbox.metrics() if self.toolbox is not None else {})}

    def token_limit(self) -> int:
        """Most tokens after the prompt, before the positions bound."""
        return self.budget.max_episode_tokens or self.budget.max_model_len

    async def run(self, row, sampling) -> Episode:
        env = self.make_env()
        prompt = await self._open(env, row)
        if isinstance(prompt, Failure):
            return Episode(prompt_len=len(row.prompt_ids), sequence=list(row.prompt_ids), finish_reason="env_error",
                           env_error=prompt.reason)
        episode = Episode(prompt_len=len(prompt), sequence=list(prompt))
        while episode.turns < self.budget.max_turns:
            room = min(self.token_limit() - episode.after_prompt(), self.budget.max_model_len - len(episode.sequence))
            if room <= 0:
                episode.finish_reason = "max_episode_tokens"
                return episode
            (completion,) = await self.engine.sample(list(episode.sequence), sampling, 1)
            if not self._add_model_turn(episode, completion, room):
                return episode
            result = await self._env_call(env.step(episode.last_text), "step")
            if not isinstance(result, (Failure, StepResult)):
                result = self._failed("bad_result", f"step returned {type(result).__name__}, not a StepResult")
            if isinstance(result, Failure):
                episode.finish_reason, episode.env_error = "env_error", result.reason
                return episode
            if result.reward is not None:
                episode.rewards.append(float(result.reward))
            episode.info.update(result.info)
            episode.tool_calls += result.tool_calls
            if result.done:
                episode.finish_reason = "stop"
                return episode
            if episode.turns == self.budget.max_turns:
                break  # no model turn would read the observation
            if not self._add_env_turn(episode, result.messages):
                return episode
        episode.finish_reason = "max_turns"
        return episode

    async def _open(self, env, row):
        """The episode's prompt ids from the environment's opening (or the row's prompt), or a Failure."""
        opening = await self._env_call(env.reset(row_dict(row)), "reset")
        if isinstance(opening, Failure):
            return opening
        opening = opening if opening is not None else row.messages
        problem = messages_problem(opening)
        if problem:
            return self._failed("bad_messages", f"reset: {problem}")
        prompt = self._render(lambda: self.appender.prompt_ids(opening))
        if not isinstance(prompt, Failure) and len(prompt) > self.budget.max_prompt_tokens:
            raise PromptTooLong(f"{row.prompt_id}: the episode's opening is {len(prompt)} tokens > "
                                f"data.max_prompt_tokens={self.budget.max_prompt_tokens}")
        return prompt

    def _add_model_turn(self, episode: Episode, completion, room: int) -> bool:
        """Append what the engine sampled; False when the episode ends with it (cut by the budget, by max_tokens,
        or aborted: nothing to continue from)."""
        episode.add_model_turn(completion, room, self.tokenizer)
        return episode.finish_reason == "stop"

    def _add_env_turn(self, episode: Episode, messages: list) -> bool:
        """Append the environment's messages as ids (loss_mask 0); False when they cannot be, or leave the model
        no room to answer."""
        problem = messages_problem(messages)
        appended = self._failed("bad_messages", f"step: {problem}") if problem else \
            self._render(lambda: self.appender.append_ids(messages))
        if isinstance(appended, Failure):
            episode.finish_reason, episode.env_error = "env_error", appended.reason
            return False
        if (episode.after_prompt() + len(appended) >= self.token_limit()
                or len(episode.sequence) + len(appended) >= self.budget.max_model_len):
            episode.finish_reason = "max_episode_tokens"
            return False
        episode.add_env_turn(appended)
        return True

    def _render(self, render):
        """The chat template on the environment's messages; messages it cannot render (no role, a content that is
        not text, a template's own error) end the episode instead of the generator."""
        try:
            return render()
        except TemplateCannotAppend as err:
            return self._failed("cannot_append", str(err))
        except Exception as err:
            return self._failed("bad_messages", f"the chat template could not render them: {type(err).__name__}: "
                                                f"{err}")

    def _failed(self, reason: str, message: str) -> "Failure":
        log.warning("environment: %s", message)
        self.env_errors[reason] += 1
        return Failure(reason)

    async def _env_call(self, call, what: str):
        """The environment's coroutine under the step timeout; a raise or a timeout is a `Failure`, counted."""
        try:
            return await asyncio.wait_for(call, self.step_timeout_s)
        except asyncio.TimeoutError:
            return self._failed("timeout", f"{what} timed out after {self.step_timeout_s:g} s")
        except Exception as err:  # the environment's own bug ends its episode, not the generator
            return self._failed("error", f"{what} failed: {type(err).__name__}: {err}")


@dataclass
class Failure:
    reason: str


def row_dict(row) -> dict:
    return {"prompt_id": row.prompt_id, "prompt": row.messages, "data_source": row.data_source,
            "ground_truth": row.ground_truth, "extra_info": row.extra_info}


def episodes_to_samples(episodes: list, rewards: list, infos: list) -> tuple[np.ndarray, list]:
    """(the group's prompt ids, one Sample per episode). The prompt is the longest prefix every episode's opening
    shares (an environment may open each episode differently); the rest of an opening is part of its sample, with
    loss_mask 0. Environment tokens get the version of the episode's first model token, so the group's staleness
    is that of its oldest model token either way."""
    openings = [episode.sequence[:episode.prompt_len] for episode in episodes]
    shared = common_prefix_len(openings)
    samples = []
    for episode, reward, info in zip(episodes, rewards, infos):
        extra = episode.prompt_len - shared
        model_versions = [v for v, m in zip(episode.versions, episode.loss_mask) if m]
        first = model_versions[0] if model_versions else 0
        versions = [first] * extra + [v if m else first for v, m in zip(episode.versions, episode.loss_mask)]
        samples.append(Sample(
            completion_ids=np.asarray(episode.sequence[shared:], dtype=np.int32),
            logprobs=np.asarray([0.0] * extra + episode.logprobs, dtype=np.float32),
            versions=np.asarray(versions, dtype=np.int32),
            loss_mask=np.asarray([0] * extra + episode.loss_mask, dtype=np.uint8),
            reward=reward, finish_reason=episode.finish_reason, reward_info=info))
    return np.asarray(openings[0][:shared], dtype=np.int32), samples


def common_prefix_len(sequences: list) -> int:
    shortest = min(len(sequence) for sequence in sequences)
    for index in range(shortest):
        token = sequences[0][index]
        if any(sequence[index] != token for sequence in sequences):
            return index
    return shortest
