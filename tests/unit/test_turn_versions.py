"""An episode whose turns were sampled by different weight versions, from the engine's per-token tags to the
learner's staleness: each turn keeps the versions its tokens came with (update_mode keep and abort split a turn
that was running when the load landed), environment tokens are masked and never lower the group's oldest version,
and the learner measures the group's staleness from its oldest model token (buffer/staleness.py, learner/collect.py).
The real engines' side is tests/integration/test_turn_versions.py."""
import asyncio
import time

import numpy as np

from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.configs.sections import RewardConfig
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.agents.chat_render import ChatAppender
from asyncrl.generator.agents.environment import StepResult
from asyncrl.generator.agents.episode import EpisodeBudget, EpisodeRunner
from asyncrl.generator.config import RolloutConfig
from asyncrl.generator.engines.base import Completion
from asyncrl.generator.rollout import RolloutLoop
from asyncrl.learner.collect import collect_batch
from tests.chat_tokenizer import chat_tokenizer
from tests.queue_server import QueueServer

ROW = PromptRow(prompt_id="p0", prompt_ids=[1], data_source="t", ground_truth="5", extra_info={},
                messages=[{"role": "user", "content": "what is 2+3?"}])
# per episode, the versions of each model turn's tokens, as the engine tags them: episode 0's second turn was
# running when v5 landed (keep and abort: its first tokens are v4's, the rest v5's); episode 1 started on v5
TURNS = [[[4, 4, 4], [4, 4, 5, 5], [5, 5]], [[5, 5], [5, 5, 5], [6, 6]]]


class VersionedEngine:
    """Answers each episode's turns with the scripted per-token versions (the prompt tells the episodes apart:
    episode 0 opens with '0')."""

    def __init__(self, tokenizer):
        self.tokenizer, self.next_turn = tokenizer, {0: 0, 1: 0}

    async def sample(self, prompt_ids, sampling, n):
        episode = int(self.tokenizer.decode(prompt_ids).split("what is ")[1][0] != "2")
        versions = TURNS[episode][self.next_turn[episode]]
        self.next_turn[episode] += 1
        ids = [self.tokenizer.convert_tokens_to_ids("x")] * (len(versions) - 1) + [self.tokenizer.eos_token_id]
        return [Completion(token_ids=ids, logprobs=[-0.5] * len(ids), versions=list(versions), finish_reason="stop")]


class AskAgain:
    opened = 0

    async def reset(self, row):
        AskAgain.opened += 1
        return [{"role": "user", "content": "what is 2+3?" if AskAgain.opened == 1 else "what is 3+3?"}]

    async def step(self, text):
        return StepResult(messages=[{"role": "user", "content": "and again?"}])


def sampled_group() -> Group:
    tokenizer = chat_tokenizer()
    AskAgain.opened = 0
    runner = EpisodeRunner(VersionedEngine(tokenizer), tokenizer, ChatAppender(tokenizer), AskAgain,
                           EpisodeBudget(max_turns=3, max_episode_tokens=0, max_model_len=4096,
                                         max_prompt_tokens=2048), step_timeout_s=10.0)
    loop = RolloutLoop(client=None, engine=runner.engine, prompts=iter([]), scorer=ZeroScorer(), tokenizer=tokenizer,
                       rollout_cfg=RolloutConfig(n=2, max_tokens=16, max_turns=3), max_inflight_groups=1,
                       generator_id="gen", reward_shaping=RewardConfig(), episodes=runner)
    return asyncio.run(loop.sampler.sample(ROW))


class ZeroScorer:
    seconds, calls = 0.0, 0

    def error_counts(self):
        return {}

    async def score(self, data_source, text, ground_truth, extra_info, prompt_id="?", prompt=None):
        return float(len(text) % 2), {}


def test_each_turn_keeps_the_versions_that_sampled_it_and_the_group_is_as_old_as_its_oldest_model_token():
    group = sampled_group()
    for sample, turns in zip(group.samples, TURNS):
        mask = sample.loss_mask.astype(bool)
        assert sample.versions[mask].tolist() == [v for turn in turns for v in turn]  # as tagged, in order
        assert np.all(sample.logprobs[~mask] == 0.0) and (~mask).sum() > 0
        # environment tokens (and the part of an opening the episodes do not share) carry the episode's first
        # model token's version: never older than a model token, so they cannot make the group look staler
        assert np.all(sample.versions[~mask] == turns[0][0])
    assert group.min_version() == 4


def test_environment_tokens_never_count_toward_the_groups_oldest_version():
    sample = Sample(completion_ids=np.arange(6, dtype=np.int32), logprobs=np.zeros(6, np.float32),
                    versions=np.array([0, 6, 6, 0, 7, 0], np.int32), loss_mask=np.array([0, 1, 1, 0, 1, 0], np.uint8),
                    reward=0.0, finish_reason="stop")
    group = Group(group_id="g", prompt_id="p", generator_id="gen", prompt_ids=np.array([1], np.int32),
                  samples=[sample], sampling=Sampling(temperature=1.0), created_at=time.time())
    assert group.min_version() == 6


def test_the_learner_measures_a_multi_version_episodes_staleness_from_its_first_turn():
    """Trained version 4 + η: the group is taken with staleness η (its oldest token, turn 1 of episode 0, is v4);
    one version later it is dropped as stale, though every token of the later turns (v5, v6) is within η."""
    max_staleness = 2
    kept = collect_batch(QueueServer([sampled_group()]), 1, max_staleness, 4 + max_staleness, timeout_s=5)
    assert kept.staleness == [max_staleness] and not kept.dropped
    server = QueueServer([sampled_group()])
    dropped = collect_batch(server, 1, max_staleness, 5 + max_staleness, timeout_s=0.3, data_done=lambda: True)
    assert dropped.groups == [] and dropped.dropped["stale"] == 1 and server.reasons == ["stale"]
