"""Sampling one prompt into one `Group` (buffer/group.py): n completions, or n multi-turn episodes, each scored by
the job's reward (off the event loop: generator/rewards/scorer.py) and shaped (reward.overlong_*, DAPO).

A reward call that fails scores 0 (the scorer counts it) and never stops the generator; so does an episode the
environment broke. A prompt whose episode opening is too long is skipped (None, counted), not sent.
"""
import asyncio
import logging
import math
import time

import numpy as np

from asyncrl.buffer.group import Group, Sample, Sampling, new_group_id
from asyncrl.configs.sections import RewardConfig
from asyncrl.generator.agents.episode import PromptTooLong, episodes_to_samples
from asyncrl.generator.rewards.functions import overlong_penalty

log = logging.getLogger(__name__)


async def score_text(scorer, row, text: str) -> tuple[float, dict]:
    """The job's reward of `text` as an answer to `row` (a PromptRow or a dealt prompt)."""
    return await scorer.score(row.data_source, text, row.ground_truth, row.extra_info, prompt_id=row.prompt_id,
                              prompt=row.messages)


async def episode_reward(scorer, row, episode, env_errors) -> tuple[float, dict]:
    """An episode's reward, alike in training and in `asyncrl eval`: the environment's rewards when it gave any,
    else the reward function on the last model turn; an episode the environment broke scores 0, and a non-finite
    sum of rewards (which the learner would reject the whole group for) scores 0, counted in `env_errors`."""
    if episode.env_error:
        return 0.0, {"env_error": 1.0}
    info = {key: float(value) for key, value in episode.info.items()
            if isinstance(value, (int, float)) and math.isfinite(value)}
    if episode.rewards:
        reward = float(sum(episode.rewards))
        if not math.isfinite(reward):
            env_errors["bad_reward"] += 1
            return 0.0, {**info, "env_error": 1.0}
        return reward, info
    reward, scored = await score_text(scorer, row, episode.last_text)
    return reward, {**info, **scored}


class GroupSampler:
    def __init__(self, engine, scorer, tokenizer, rollout_cfg, generator_id: str, stats, reward_shaping=None,
                 episodes=None):
        """`rollout_cfg`: the rollout section (n, temperature, top_p, top_k, max_tokens, greedy_baseline);
        `stats`: the RolloutStats the samples are counted in; `episodes`: agents/episode.py EpisodeRunner, with
        tools or an environment (then each sample is a multi-turn episode)."""
        self.engine, self.scorer, self.tokenizer = engine, scorer, tokenizer
        self.rollout, self.generator_id, self.stats = rollout_cfg, generator_id, stats
        self.reward_shaping = reward_shaping or RewardConfig()
        self.episodes = episodes

    async def sample(self, row) -> Group | None:
        """One group of `row`: n samples, scored; None when there is nothing to send for it."""
        rollout = self.rollout
        sampling = Sampling(rollout.temperature, rollout.top_p, rollout.top_k, rollout.max_tokens)
        created = time.time()
        meta = {"data_source": row.data_source}
        if row.deal_id is not None:  # the learner accepts the group only under its deal
            meta["deal"] = row.deal_id
        if self.episodes is not None:
            return await self._sample_episodes(row, sampling, created, meta)
        images = image_inputs(row)
        sampled = self.engine.sample(row.prompt_ids, sampling, rollout.n, **images)
        if rollout.greedy_baseline:
            # ReMax: one greedy decode of the same prompt, scored like the others; its reward is the baseline.
            greedy = Sampling(0.0, 1.0, -1, rollout.max_tokens)
            completions, (baseline,) = await asyncio.gather(sampled, self.engine.sample(row.prompt_ids, greedy, 1,
                                                                                        **images))
            meta["baseline_reward"], _ = await self._score(row, baseline)
            self.stats.tokens += len(baseline.token_ids)
        else:
            completions = await sampled
        scores = await asyncio.gather(*(self._score(row, completion) for completion in completions))
        samples = []
        for completion, (reward, info) in zip(completions, scores):
            self.stats.rewards.append(reward)
            self.stats.tokens += len(completion.token_ids)
            samples.append(Sample(
                completion_ids=np.asarray(completion.token_ids, dtype=np.int32),
                logprobs=np.asarray(completion.logprobs, dtype=np.float32),
                versions=np.asarray(completion.versions, dtype=np.int32),
                reward=reward, finish_reason=completion.finish_reason, reward_info=info,
                routed_experts=completion.routed_experts,
            ))
        self.stats.groups += 1
        return Group(group_id=new_group_id(), prompt_id=row.prompt_id, generator_id=self.generator_id,
                     prompt_ids=np.asarray(row.prompt_ids, dtype=np.int32), samples=samples, sampling=sampling,
                     created_at=created, meta=meta)

    async def _sample_episodes(self, row, sampling: Sampling, created: float, meta: dict) -> Group | None:
        """n episodes of the prompt, concurrently; None (skipped, counted) when the opening is too long."""
        if row.images:
            raise ValueError(f"prompt {row.prompt_id} has images, and episodes (tools, environments, agents) take "
                             f"text only")
        runs = await asyncio.gather(*(self.episodes.run(row, sampling) for _ in range(self.rollout.n)),
                                    return_exceptions=True)
        for outcome in runs:
            if isinstance(outcome, PromptTooLong):
                self.stats.skipped_prompts += 1
                log.warning("generator %s: %s; skipped", self.generator_id, outcome)
                return None
            if isinstance(outcome, BaseException):
                raise outcome
        scores = await asyncio.gather(*(self._episode_reward(row, episode) for episode in runs))
        prompt_ids, samples = episodes_to_samples(runs, [reward for reward, _ in scores], [info for _, info in scores])
        if len(prompt_ids) == 0:
            self.stats.skipped_prompts += 1
            log.warning("generator %s: the %d episodes of %s share no opening token; skipped", self.generator_id,
                        len(runs), row.prompt_id)
            return None
        for episode, (reward, _) in zip(runs, scores):
            self.stats.rewards.append(reward)
            self.stats.tokens += episode.model_tokens()
            self.stats.episode_counts.append((episode.turns, episode.tool_calls, episode.env_tokens))
        self.stats.groups += 1
        return Group(group_id=new_group_id(), prompt_id=row.prompt_id, generator_id=self.generator_id,
                     prompt_ids=prompt_ids, samples=samples, sampling=sampling, created_at=created, meta=meta)

    async def _episode_reward(self, row, episode) -> tuple[float, dict]:
        return await episode_reward(self.scorer, row, episode, self.episodes.env_errors)

    async def _score(self, row, completion) -> tuple[float, dict]:
        """Task reward plus DAPO overlong shaping (reward.overlong_*), with the shaping also in reward_info."""
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        reward, info = await score_text(self.scorer, row, text)
        shaping = self.reward_shaping
        if shaping.overlong_buffer_len > 0:
            penalty = overlong_penalty(len(completion.token_ids), self.rollout.max_tokens,
                                       shaping.overlong_buffer_len, shaping.overlong_penalty_factor)
            info = {**info, "overlong_penalty": penalty}
            reward += penalty
        return reward, info


def image_inputs(row) -> dict:
    """The engine's keyword for a multimodal row's images (none for a text row: an engine that takes no images
    is called as it always was)."""
    return {"images": row.images} if row.images else {}
