"""Running one multi-turn episode, and turning a prompt's n episodes into the samples of one `Group`.

Contract of `EpisodeRunner.run(row, sampling)`: the environment's reset gives the opening messages, rendered
once into the prompt; then, until a budget or the environment ends it, the engine samples a model turn from the
whole sequence so far, the environment steps on that turn's text, and its messages are appended as ids
(chat_render.py). The tokens sent to the engine at turn k are exactly turn k-1's, plus what turn k-1 sampled,
plus the appended ids: nothing is re-tokenized.

With per-turn samples (rollout.turn_samples=per_turn, for templates that rewrite earlier turns) the episode keeps
its messages instead: each model turn's text joins them as an assistant message, and the next turn's prompt is
the chat template's render of the whole history (`rebase`), not an append. Each model turn then becomes its own
sample (`episodes_to_samples`): the ids the engine was given at that turn and the ids it sampled, never decoded
and re-encoded; only the model's text, as it reads in the next prompt, is the template's business.

`run` waits on the engine and on the environment (each reset and step under `step_timeout_s`); it never raises
for what the environment does (`env_error` ends the episode).

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
    per_turn: bool = False  # rollout.turn_samples=per_turn: `sequence` is the current turn's prompt and completion
    turn_samples: list = field(default_factory=list)  # per_turn: a TurnSample per model turn

    def model_tokens(self) -> int:
        """Tokens the model sampled in the episode (all turns)."""
        if self.per_turn:
            return sum(len(turn.ids) for turn in self.turn_samples)
        return sum(self.loss_mask)

    def rebase(self, prompt: list) -> None:
        """Per-turn samples: the next model turn reads `prompt` (the template's render of the whole history) in
        place of the sequence so far; what follows the opening counts against the episode's token budget."""
        grown = len(prompt) - len(self.sequence)
        self.sequence = list(prompt)
        after = max(len(prompt) - self.prompt_len, 0)
        self.logprobs, self.versions, self.loss_mask = [0.0] * after, [-1] * after, [0] * after
        self.env_tokens += max(grown, 0)

    def after_prompt(self) -> int:
        return len(self.sequence) - self.prompt_len

    def add_model_turn(self, completion, room: int, tokenizer) -> None:
        """Append what the engine sampled (loss_mask 1), cut to `room` tokens; the finish reason becomes the
        engine's, or max_episode_tokens when it was cut."""
        ids = list(completion.token_ids)[:room]
        if self.per_turn:
            self.turn_samples.append(TurnSample(list(self.sequence), ids, list(completion.logprobs)[:room],
                                                list(completion.versions)[:room]))
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


@dataclass
class TurnSample:
    """One model turn of a per-turn episode: the ids the engine was given, and what it sampled from them."""
    prompt: list
    ids: list
    logprobs: list
    versions: list


class EpisodeRunner:
    """Runs episodes against `make_env()` (a fresh environment per episode) on `engine`. `appender`: a
    chat_render.ChatAppender, or with per-turn samples a ChatRenderer (`per_turn`)."""

    def __init__(self, engine, tokenizer, appender, make_env: Callable, budget: EpisodeBudget, step_timeout_s: float,
                 toolbox=None, per_turn: bool = False):
        self.engine, self.tokenizer, self.appender, self.per_turn = engine, tokenizer, appender, per_turn
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
        opened = await self._open(env, row)
        if isinstance(opened, Failure):
            return Episode(prompt_len=len(row.prompt_ids), sequence=list(row.prompt_ids), finish_reason="env_error",
                           env_error=opened.reason, per_turn=self.per_turn)
        prompt, history = opened  # history: per_turn, the conversation so far as messages
        episode = Episode(prompt_len=len(prompt), sequence=list(prompt), per_turn=self.per_turn)
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
            if not self._add_env_turn(episode, result.messages, history):
                return episode
        episode.finish_reason = "max_turns"
        return episode

    async def _open(self, env, row):
        """(the episode's prompt ids, its opening messages) from the environment's opening (or the row's prompt),
        or a Failure."""
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
        return prompt if isinstance(prompt, Failure) else (prompt, list(opening))

    def _add_model_turn(self, episode: Episode, completion, room: int) -> bool:
        """Append what the engine sampled; False when the episode ends with it (cut by the budget, by max_tokens,
        or aborted: nothing to continue from)."""
        episode.add_model_turn(completion, room, self.tokenizer)
        return episode.finish_reason == "stop"

    def _add_env_turn(self, episode: Episode, messages: list, history: list) -> bool:
        """Append the environment's messages as ids (loss_mask 0), or with per-turn samples render the next
        prompt from the whole `history` (which gets the model's turn and the messages); False when they cannot
        be, or leave the model no room to answer."""
        problem = messages_problem(messages)
        if problem:
            appended = self._failed("bad_messages", f"step: {problem}")
        elif self.per_turn:
            history += [{"role": "assistant", "content": episode.last_text}, *messages]
            appended = self._render(lambda: self.appender.prompt_ids(history))
        else:
            appended = self._render(lambda: self.appender.append_ids(messages))
        if isinstance(appended, Failure):
            episode.finish_reason, episode.env_error = "env_error", appended.reason
            return False
        grown = len(appended) - len(episode.sequence) if self.per_turn else len(appended)
        if (episode.after_prompt() + grown >= self.token_limit()
                or len(episode.sequence) + grown >= self.budget.max_model_len):
            episode.finish_reason = "max_episode_tokens"
            return False
        if self.per_turn:
            episode.rebase(appended)
        else:
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
    """(the group's prompt ids, its samples): one Sample per episode, or with per-turn episodes one per model turn
    (`turn_samples_of`). The prompt is the longest prefix every sample's prompt shares (an environment may open
    each episode differently, and each turn's prompt differs); the rest of a prompt is part of its sample, with
    loss_mask 0. Environment tokens get the version of the sample's first model token, so the group's staleness is
    that of its oldest model token either way."""
    if any(episode.per_turn for episode in episodes):
        return turn_samples_of(episodes, rewards, infos)
    openings = [episode.sequence[:episode.prompt_len] for episode in episodes]
    shared = common_prefix_len(openings)
    samples = []
    for episode, reward, info in zip(episodes, rewards, infos):
        extra = episode.prompt_len - shared
        samples.append(sample_of(episode.sequence[shared:], [0.0] * extra + episode.logprobs,
                                 [-1] * extra + episode.versions, [0] * extra + episode.loss_mask,
                                 reward, episode.finish_reason, info))
    return np.asarray(openings[0][:shared], dtype=np.int32), samples


def turn_samples_of(episodes: list, rewards: list, infos: list) -> tuple[np.ndarray, list]:
    """Per-turn samples: each model turn of episode i is a Sample with `episode` i, whose ids are the prompt the
    engine was given at that turn (loss_mask 0 after the group's prompt) and what it sampled (loss_mask 1), with
    the episode's reward. Earlier turns end with `stop` (the model ended them), the last with the episode's finish
    reason. An episode with no model turn (its environment failed at reset) is one sample without model tokens."""
    turns = []  # (episode index, prompt, TurnSample or None)
    for index, episode in enumerate(episodes):
        if not episode.turn_samples:
            turns.append((index, episode.sequence, None))
        turns += [(index, turn.prompt, turn) for turn in episode.turn_samples]
    shared = common_prefix_len([prompt for _, prompt, _ in turns])
    samples = []
    for index, prompt, turn in turns:
        episode = episodes[index]
        extra = len(prompt) - shared
        ids, logprobs, versions = (turn.ids, turn.logprobs, turn.versions) if turn else ([], [], [])
        last = turn is None or turn is episode.turn_samples[-1]
        sample = sample_of(prompt[shared:] + ids, [0.0] * extra + logprobs, [-1] * extra + versions,
                           [0] * extra + [1] * len(ids), rewards[index],
                           episode.finish_reason if last else "stop", infos[index])
        sample.episode = index
        samples.append(sample)
    return np.asarray(turns[0][1][:shared], dtype=np.int32), samples


def sample_of(ids: list, logprobs: list, versions: list, loss_mask: list, reward: float, finish_reason: str,
              info: dict) -> Sample:
    """A Sample; versions -1 (tokens no policy sampled) become the sample's first model token's version."""
    model = [v for v, m in zip(versions, loss_mask) if m]
    first = model[0] if model else 0
    return Sample(completion_ids=np.asarray(ids, dtype=np.int32), logprobs=np.asarray(logprobs, dtype=np.float32),
                  versions=np.asarray([v if m else first for v, m in zip(versions, loss_mask)], dtype=np.int32),
                  loss_mask=np.asarray(loss_mask, dtype=np.uint8), reward=reward, finish_reason=finish_reason,
                  reward_info=info)


def common_prefix_len(sequences: list) -> int:
    shortest = min(len(sequence) for sequence in sequences)
    for index in range(shortest):
        token = sequences[0][index]
        if any(sequence[index] != token for sequence in sequences):
            return index
    return shortest
