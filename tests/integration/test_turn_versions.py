"""Weights that change between the turns of one episode, in every generator.update_mode, on the real engines.

The episode runs through the generator's own path (RolloutLoop's sampler -> agents/episode.py EpisodeRunner ->
episodes_to_samples -> a Group), and a new version is loaded between its first and second model turn the way the
generator loads one: its WeightFollower hears the announcement and `ensure_latest` stages and loads it (what
another rollout worker does when it starts a group while this episode waits on its environment). In every mode
the load lands: `wait` waits for in-flight *requests* (model turns), not for episodes, and between two turns of an
episode none of its requests is in flight. The new version is the demo model perturbed, so turn 2 being the new
weights' is checked on its logprobs, not only on its tags.
"""
import asyncio

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.configs.sections import RewardConfig
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.agents.chat_render import ChatAppender
from asyncrl.generator.agents.environment import StepResult
from asyncrl.generator.agents.episode import EpisodeBudget, EpisodeRunner
from asyncrl.generator.config import RolloutConfig
from asyncrl.generator.engines.base import EngineOptions
from asyncrl.generator.rollout import RolloutLoop
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import load_model, load_tokenizer
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage

TEMPERATURE = 0.7
ROW = PromptRow("p", [], "asyncrl/sort_digits", "0125", {}, messages=[{"role": "user", "content": "sort:5021="}])


class LoadAfterTurnOne:
    """Answers every model turn with another sorting task; after the first, brings the engine to the newest
    announced version through the generator's WeightFollower before answering."""

    def __init__(self, follower, seen: list):
        self.follower, self.seen, self.turns = follower, seen, 0

    async def reset(self, row):
        return None

    async def step(self, text):
        self.turns += 1
        if self.turns == 1:
            await self.follower.ensure_latest()
        self.seen.append(self.follower.engine.version)
        return StepResult(messages=[{"role": "user", "content": "sort:312="}])


class LoadOnTheFirstStep:
    """Several episodes at once: the first step of any of them loads the newest announced version while the others'
    turns are being sampled (what a concurrent group's start does); `shared['loaded']` says one did."""

    def __init__(self, follower, shared: dict):
        self.follower, self.shared, self.turns = follower, shared, 0

    async def reset(self, row):
        return None

    async def step(self, text):
        self.turns += 1
        if not self.shared["loaded"]:
            self.shared["loaded"] = True
            await self.follower.ensure_latest()
        return StepResult(messages=[{"role": "user", "content": "sort:312="}])


class InlineScorer:
    seconds, calls = 0.0, 0

    def error_counts(self):
        return {}

    async def score(self, data_source, text, ground_truth, extra_info, prompt_id="?", prompt=None):
        return 0.0, {}


def sorting_tokenizer(model_dir):
    """The demo tokenizer with a template that ends each assistant turn with its eos (the stop token), so turns
    can be appended."""
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>" \
                              "{% endif %}{% endfor %}"
    return tokenizer


def perturbed(model_dir):
    model = load_model(model_dir).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def publish(publisher, state: dict, version: int):
    specs = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]
    return publisher.publish(iter(state.items()), version, specs)


def model_turns(mask) -> list:
    """(start, end) of each run of model tokens (loss_mask 1) in a sample's completion."""
    runs, start = [], None
    for index, bit in enumerate(list(mask) + [0]):
        if bit and start is None:
            start = index
        elif not bit and start is not None:
            runs.append((start, index))
            start = None
    return runs


def run_until_two_turns(engine, model_dir, tmp_path, run, n=1, make_env=None):
    """Groups of `n` episodes until the new version was loaded: the environment (`make_env(follower)`; by default
    LoadAfterTurnOne) loads it in a step, which only a first turn that ends with the stop token reaches (a turn cut
    by max_tokens ends its episode). Returns (the group, the old version, the new one, the versions
    LoadAfterTurnOne saw after each step)."""
    tokenizer = sorting_tokenizer(model_dir)
    seen: list = []
    holder: dict = {}
    make_env = make_env or (lambda follower: LoadAfterTurnOne(follower, seen))
    runner = EpisodeRunner(engine, tokenizer, ChatAppender(tokenizer), lambda: make_env(holder["loop"].weights),
                           EpisodeBudget(max_turns=3, max_episode_tokens=0, max_model_len=64, max_prompt_tokens=16),
                           step_timeout_s=60.0)
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 3, 1 << 20), WeightStage(str(tmp_path), "turns")
    loop = holder["loop"] = RolloutLoop(
        client=None, engine=engine, prompts=iter([]), scorer=InlineScorer(), tokenizer=tokenizer,
        rollout_cfg=RolloutConfig(n=n, max_tokens=8, max_turns=3, temperature=TEMPERATURE), max_inflight_groups=1,
        generator_id="g", reward_shaping=RewardConfig(), stage=stage, episodes=runner)
    old = engine.version
    new = old + 1
    loop.weights.hear(publish(publisher, perturbed(model_dir).state_dict(), new))
    try:
        for _ in range(8):
            group = run(loop.sampler.sample(ROW))
            if engine.version == new:
                return group, old, new, seen
        pytest.fail("in 8 groups no episode's first turn ended with the stop token (none reached a step)")
    finally:  # the demo model's weights back (as a later version) for the other tests on the shared engine
        loop.weights.hear(publish(publisher, load_model(model_dir).state_dict(), new + 1))
        run(loop.weights.ensure_latest())
        assert engine.version == new + 1
        stage.close()
        publisher.close()


def check_turn_versions(group, old: int, new: int, model_dir):
    """Turn 1: all `old`, the old model's logprobs; turn 2 on: all `new`, the new model's; environment tokens
    masked; the group's oldest model token (its staleness) is turn 1's."""
    (sample,) = group.samples
    turns = model_turns(sample.loss_mask)
    (first_start, first_end), (second_start, second_end) = turns[0], turns[1]
    versions = sample.versions.tolist()
    assert set(versions[first_start:first_end]) == {old}
    for start, end in turns[1:]:
        assert set(versions[start:end]) == {new}, versions
    env = ~sample.loss_mask.astype(bool)
    assert env[first_end:second_start].all() and np.all(sample.logprobs[env] == 0.0)
    assert group.min_version() == old  # the oldest model token's, whatever the environment tokens carry
    ids = torch.tensor([group.prompt_ids.tolist() + sample.completion_ids.tolist()])
    offset = len(group.prompt_ids) - 1  # logprob of completion token i sits at position offset + i
    with torch.no_grad():
        for model, (start, end) in ((load_model(model_dir).eval(), turns[0]), (perturbed(model_dir), turns[1])):
            expected, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([TEMPERATURE]), 64)
            expected = expected[0, offset + start: offset + end].numpy()
            assert np.max(np.abs(expected - sample.logprobs[start:end])) < 1e-4, (start, end)


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["wait", "keep", "abort"])
def test_vllm_turns_carry_the_version_that_sampled_them_in_every_update_mode(vllm_engine, demo_assets,
                                                                            event_loop_runner, tmp_path, mode):
    vllm_engine.update_mode = mode
    try:
        group, old, new, seen = run_until_two_turns(vllm_engine, demo_assets[0], tmp_path,
                                                    event_loop_runner.run_until_complete)
    finally:
        vllm_engine.update_mode = "wait"
    assert seen[0] == new  # the load landed in the step between turn 1 and turn 2, in every mode
    check_turn_versions(group, old, new, demo_assets[0])


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["wait", "keep", "abort"])
def test_vllm_a_load_while_other_episodes_turns_run_keeps_every_tokens_version(vllm_engine, demo_assets,
                                                                              event_loop_runner, tmp_path, mode):
    """Four episodes at once; the first step of any loads the new version while the others' turns may be running.
    Every model token is the old or the new version, never going back within an episode; with `wait` no turn spans
    both (a load waits for running requests), with keep and abort one may; the group is as old as turn 1."""
    shared = {"loaded": False}
    vllm_engine.update_mode = mode
    try:
        group, old, new, _ = run_until_two_turns(vllm_engine, demo_assets[0], tmp_path,
                                                 event_loop_runner.run_until_complete, n=4,
                                                 make_env=lambda follower: LoadOnTheFirstStep(follower, shared))
    finally:
        vllm_engine.update_mode = "wait"
    for sample in group.samples:
        versions = sample.versions.tolist()
        model = sample.versions[sample.loss_mask.astype(bool)].tolist()
        assert set(versions) <= {old, new} and model == sorted(model)
        for start, end in model_turns(sample.loss_mask):
            assert mode != "wait" or len(set(versions[start:end])) == 1, versions
    assert group.min_version() == old
    assert any(new in sample.versions[sample.loss_mask.astype(bool)] for sample in group.samples)


def test_hf_engine_turns_carry_the_version_that_sampled_them(demo_assets, tmp_path):
    """The hf engine (update_mode wait only) loads between its batches; an episode's next turn is a new batch."""
    from asyncrl.generator.engines.hf_engine import HfEngine

    loop = asyncio.new_event_loop()
    engine = HfEngine(EngineOptions(demo_assets[0], dtype="float32", max_model_len=64, kv_cache_gib=0.1, seed=0))
    try:
        loop.run_until_complete(engine.start())
        group, old, new, seen = run_until_two_turns(engine, demo_assets[0], tmp_path, loop.run_until_complete)
        assert seen[0] == new
        check_turn_versions(group, old, new, demo_assets[0])
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
