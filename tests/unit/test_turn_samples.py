"""Per-turn samples (rollout.turn_samples=per_turn) with a template that strips reasoning from earlier turns: each
model turn's prompt is exactly the ids the engine was given and its completion exactly the ids it sampled; the
group's samples carry their episode, pass the buffer's checks, and get their episode's advantage; `episode` mode
still refuses such a template, naming the option."""
import asyncio

import numpy as np
import pytest
import torch

from asyncrl.buffer.codec import CodecError, decode_group, encode_group
from asyncrl.buffer.group import Group, Sampling
from asyncrl.buffer.plausibility import JobLimits
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.agents.chat_render import ChatRenderer, TemplateCannotAppend, resolve_turn_samples
from asyncrl.generator.agents.environment import StepResult
from asyncrl.generator.agents.episode import EpisodeBudget, EpisodeRunner, episodes_to_samples
from asyncrl.algos.turn_advantages import compute_turn_advantages
from tests.chat_tokenizer import chat_tokenizer
from tests.reasoning_template import reasoning_tokenizer
from tests.scripted_engine import ScriptedEngine, call

SAMPLING = Sampling(1.0, 1.0, -1, 64)
ROW = PromptRow(prompt_id="p0", prompt_ids=[1], data_source="t", ground_truth="5", extra_info={},
                messages=[{"role": "user", "content": "what is 2+3?"}])


class AskAgain:
    """Answers each model turn with one more user message, twice, then ends the episode."""

    def __init__(self):
        self.steps = 0

    async def reset(self, row):
        return None

    async def step(self, text):
        self.steps += 1
        return StepResult(messages=[{"role": "user", "content": f"sure? ({self.steps})"}], done=self.steps == 3)


def run_episode(tokenizer, turns):
    engine = ScriptedEngine(tokenizer, turns)
    runner = EpisodeRunner(engine, tokenizer, ChatRenderer(tokenizer), AskAgain, EpisodeBudget(4, 0, 4096, 2048),
                           step_timeout_s=10.0, per_turn=True)
    return engine, asyncio.run(runner.run(ROW, SAMPLING))


TURNS = [("<think>2 and 3</think>5", "stop"), ("<think>check</think>yes, 5", "stop"), ("<think>ok</think>5", "stop")]


def test_each_turn_is_a_sample_of_the_ids_the_engine_saw_and_sampled():
    tokenizer = reasoning_tokenizer()
    engine, episode = run_episode(tokenizer, TURNS)
    assert episode.finish_reason == "stop" and episode.turns == 3 and len(episode.turn_samples) == 3
    renderer = ChatRenderer(tokenizer)
    history = list(ROW.messages)
    for k, turn in enumerate(episode.turn_samples):
        assert turn.prompt == engine.requests[k] and turn.ids == engine.sampled[k], f"turn {k}"
        assert turn.prompt == renderer.prompt_ids(history), f"turn {k}: the template's render of the history"
        history += [{"role": "assistant", "content": TURNS[k][0]}, {"role": "user", "content": f"sure? ({k + 1})"}]
    # the template stripped the first turn's reasoning from the second turn's prompt: not an append
    assert "<think>2 and 3</think>" not in tokenizer.decode(engine.requests[1])
    assert engine.requests[1][:len(engine.requests[0]) + len(engine.sampled[0])] != \
        engine.requests[0] + engine.sampled[0]
    other = run_episode(tokenizer, [("<think>hm</think>6", "stop")] * 3)[1]
    prompt, samples = episodes_to_samples([episode, other], [1.0, 0.0], [{}, {}])
    assert len(samples) == 6 and [s.episode for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.reward for s in samples] == [1.0] * 3 + [0.0] * 3
    assert [s.finish_reason for s in samples] == ["stop"] * 6
    for sample, turn in zip(samples, episode.turn_samples):
        whole = prompt.tolist() + sample.completion_ids.tolist()
        assert whole == turn.prompt + turn.ids  # nothing re-tokenized
        assert sample.loss_mask.tolist() == [0] * (len(turn.prompt) - len(prompt)) + [1] * len(turn.ids)
        assert sample.logprobs[sample.loss_mask == 1].tolist() == [-0.25] * len(turn.ids)
        assert set(sample.versions.tolist()) == {7}
    assert episode.model_tokens() == sum(len(ids) for ids in engine.sampled)


def test_per_turn_groups_pass_the_buffer_checks_and_hostile_ones_do_not():
    tokenizer = reasoning_tokenizer()
    episodes = [run_episode(tokenizer, TURNS)[1], run_episode(tokenizer, TURNS[:1] + [("5", "stop")] * 2)[1]]
    prompt, samples = episodes_to_samples(episodes, [1.0, 0.0], [{}, {}])
    group = Group("g1", "p0", "gen", prompt, samples, SAMPLING, 0.0)
    limits = JobLimits(group_size=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64,
                       max_completion_tokens=4096, max_prompt_tokens=2048, max_positions=4096, max_turns=4)
    decode = lambda g, lim=limits: decode_group(encode_group(g), vocab_size=len(tokenizer), max_version=7,
                                                 max_message_bytes=1 << 20, limits=lim)
    back = decode(group)
    assert [s.episode for s in back.samples] == [0, 0, 0, 1, 1, 1] and back.episode_rewards() == [1.0, 0.0]
    single = JobLimits(**{**limits.__dict__, "max_turns": 1})
    with pytest.raises(CodecError, match="longer than rollout.n=2"):
        decode(group, single)  # a job that sends whole episodes never sends turns
    two = Group("g3", "p0", "gen", prompt, samples[:1] + samples[3:4], SAMPLING, 0.0)
    with pytest.raises(CodecError, match="per-turn samples .* but this job sends one sample per episode"):
        decode(two, single)
    hostile = {
        "malformed": lambda s: s[0].__setattr__("episode", None),  # mixed
        "malformed ": lambda s: s[3].__setattr__("episode", 5),  # episodes not 0..k-1
        "bad_reward": lambda s: s[1].__setattr__("reward", 0.5),  # turns of one episode disagree
        "group_size": lambda s: [(x.__setattr__("episode", 0), x.__setattr__("reward", 1.0)) for x in s[3:]],
        # ^ one episode of 6 turns, where the job samples n=2 episodes of at most 4
    }
    for reason, spoil in hostile.items():
        bad = episodes_to_samples(episodes, [1.0, 0.0], [{}, {}])[1]
        spoil(bad)
        with pytest.raises(CodecError) as err:
            decode(Group("g2", "p0", "gen", prompt, bad, SAMPLING, 0.0))
        assert err.value.reason == reason.strip(), (reason, err.value)


def test_every_turn_gets_its_episodes_advantage():
    # episode 0: 3 turns, reward 1; episode 1: 1 turn, reward 0 -> GRPO over episodes, not rows: +-0.707
    mask = torch.ones(4, 3)
    rewards = torch.zeros(4, 3)
    rewards[:3, -1] = 1.0
    advantages = compute_turn_advantages("grpo", rewards, mask, torch.tensor([0, 0, 0, 1]), group_size=2)
    expected = 0.5 / (0.5 ** 0.5 + 1e-6)  # (1 - mean) / unbiased std of the episodes' rewards [1, 0]
    assert torch.allclose(advantages[:3], torch.full((3, 3), expected), atol=1e-5)
    assert torch.allclose(advantages[3], torch.full((3,), -expected), atol=1e-5)
    # a row-wise GRPO would have put the mean at 0.75 (the 3-turn episode weighing 3 times): -1.5 for the other
    assert float(advantages[3, 0]) == pytest.approx(-0.7071, abs=1e-3)


def test_the_mode_is_chosen_from_the_template_and_episode_mode_refuses_a_rewriting_one():
    assert resolve_turn_samples("auto", chat_tokenizer())[0] == "episode"
    mode, why = resolve_turn_samples("auto", reasoning_tokenizer())
    assert mode == "per_turn" and "rewrites history" in why
    assert resolve_turn_samples("per_turn", chat_tokenizer())[0] == "per_turn"
    with pytest.raises(TemplateCannotAppend, match="rollout.turn_samples=per_turn"):
        resolve_turn_samples("episode", reasoning_tokenizer())


def test_the_recipe_refuses_per_turn_with_an_algorithm_that_cannot_train_it():
    from asyncrl.configs import load_config

    base = ["env.path=x.py", "env.name=E", "rollout.max_turns=3"]
    with pytest.raises(ValueError, match="algo.advantage=reinforce_pp is not one of"):
        load_config(None, [*base, "rollout.turn_samples=per_turn", "algo.advantage=reinforce_pp"])
    assert load_config(None, [*base, "algo.advantage=reinforce_pp"]).rollout.turn_samples == "episode"
    assert load_config(None, base).rollout.turn_samples == "auto"
    with pytest.raises(ValueError, match="rollout.turn_samples must be one of"):
        load_config(None, [*base, "rollout.turn_samples=turns"])


TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b
'''


class CallThenAnswer(ScriptedEngine):
    """Concurrent episodes: a turn without a tool result yet calls the tool, with reasoning; the next answers."""

    async def sample(self, prompt_ids, sampling, n):
        first = "<|im_start|>tool" not in self.tokenizer.decode(prompt_ids)
        self.turns = [("<think>add them</think>" + call("add", a=2, b=3) if first else "5", "stop")]
        return await super().sample(prompt_ids, sampling, n)


def test_auto_builds_per_turn_tool_episodes_and_a_group_of_their_turns(tmp_path, caplog):
    from asyncrl.configs import load_config
    from asyncrl.configs.sections import RewardConfig
    from asyncrl.generator.agents.build import build_episode_runner
    from asyncrl.generator.rollout import RolloutLoop
    from tests.inline_scorer import InlineScorer

    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS)
    cfg = load_config(None, [f"tools.functions=[{tools}:add]", "rollout.max_turns=3", "rollout.n=2"])
    tokenizer = reasoning_tokenizer()
    engine = CallThenAnswer(tokenizer, [])
    with caplog.at_level("INFO", logger="asyncrl.generator.agents.build"):
        runner = build_episode_runner(cfg.tools, cfg.env, cfg.agent, cfg.rollout, max_model_len=4096,
                                      max_prompt_tokens=2048, tool_workers=1, engine=engine, tokenizer=tokenizer)
    assert runner.per_turn and "one sample per model turn: rollout.turn_samples=auto" in caplog.text
    loop = RolloutLoop(client=None, engine=engine, prompts=iter([]), scorer=InlineScorer(), tokenizer=tokenizer,
                       rollout_cfg=cfg.rollout, max_inflight_groups=1, generator_id="g",
                       reward_shaping=RewardConfig(), episodes=runner)

    async def scenario():
        await runner.start()
        try:
            return await loop.sampler.sample(ROW)
        finally:
            await runner.close()

    group = asyncio.run(scenario())
    assert len(group.samples) == 4 and sorted(s.episode for s in group.samples) == [0, 0, 1, 1]
    assert group.episode_rewards() == [1.0, 1.0]
    pairs = sorted(zip(map(tuple, engine.requests), map(tuple, engine.sampled)))
    rows = sorted((tuple(group.prompt_ids.tolist() + s.completion_ids[:int(np.argmax(s.loss_mask))].tolist()),
                   tuple(s.completion_ids[s.loss_mask == 1].tolist())) for s in group.samples)
    assert rows == pairs  # every sample: the ids the engine was given, then exactly what it sampled
    assert loop.stats.tokens == sum(len(ids) for ids in engine.sampled)


def per_turn_group(rng, turns: list, rewards: list):
    """A group of per-turn samples: episode i has turns[i] samples, each with rewards[i]."""
    from tests.groups import make_group

    group = make_group(rng, n=sum(turns))
    index = 0
    for episode, (count, reward) in enumerate(zip(turns, rewards)):
        for sample in group.samples[index:index + count]:
            sample.episode, sample.reward = episode, reward
        index += count
    return group


def test_a_learner_step_trains_per_turn_groups_of_different_sizes():
    from asyncrl.algos.config import AlgoConfig
    from asyncrl.learner.model import build_qwen2
    from asyncrl.learner.train_step import StepSettings, train_step

    rng = np.random.default_rng(5)
    groups = [per_turn_group(rng, [3, 1], [1.0, 0.0]), per_turn_group(rng, [1, 2], [0.0, 0.0])]
    model = build_qwen2(vocab_size=32, hidden_size=32, num_layers=1, eos_token_id=1, pad_token_id=0, seed=0).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for advantage in ("grpo", "rloo"):
        result = train_step(model, optimizer, scheduler, groups, AlgoConfig(advantage=advantage),
                            StepSettings(version=0, max_staleness=2, max_tokens_per_microbatch=4096, chunk_tokens=64,
                                         grad_clip=1.0))
        metrics = result.metrics
        assert result.stepped and np.isfinite(metrics["loss/pg"]), advantage
        # rewards by episode: [1, 0] and [0, 0], not by row
        assert metrics["reward/mean"] == 0.25 and metrics["reward/frac_zero_std_groups"] == 0.5
