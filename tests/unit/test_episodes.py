"""Multi-turn episodes (generator/agents/): the turn-by-turn token check (the engine sees exactly the last turn's
tokens plus the appended ones, nothing re-tokenized), loss masks, budgets and their finish reasons, tool and
environment failures that the episode survives, templates that cannot append, and a whole group through the
rollout loop. The engine is scripted; the tools run in real worker processes."""
import asyncio

import numpy as np
import pytest

from asyncrl.buffer.group import Sampling
from asyncrl.configs.sections import RewardConfig
from asyncrl.generator.agents.chat_render import ChatAppender, TemplateCannotAppend
from asyncrl.generator.agents.environment import StepResult
from asyncrl.generator.agents.episode import EpisodeBudget, EpisodeRunner, PromptTooLong, episodes_to_samples
from asyncrl.generator.agents.tool_calls import HermesToolCallParser
from asyncrl.generator.agents.tool_env import ToolEnvironment
from asyncrl.generator.agents.tools import ToolBox
from asyncrl.generator.config import RolloutConfig
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.rollout import RolloutLoop
from tests.chat_tokenizer import chat_tokenizer
from tests.inline_scorer import InlineScorer
from tests.scripted_engine import ScriptedEngine, call

TOOLS = '''
import time

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b

def broken(x: int) -> int:
    """Always fails."""
    raise RuntimeError("the calculator is on fire")

def slow(x: int) -> int:
    """Never returns in time."""
    time.sleep(30)
    return x

def chatty(x: int) -> str:
    """Says too much."""
    return "blah " * 10000
'''
SAMPLING = Sampling(1.0, 1.0, -1, 64)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture()
def toolbox(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    box = ToolBox([f"{path}:{name}" for name in ("add", "broken", "slow", "chatty")], workers=2, timeout_s=1.0,
                  max_output_chars=200)
    return box


ROW = PromptRow(prompt_id="p0", prompt_ids=[1], data_source="t", ground_truth="5", extra_info={},
                messages=[{"role": "user", "content": "what is 2+3?"}])


def runner_for(tokenizer, toolbox, engine, max_turns=4, max_episode_tokens=0, max_model_len=4096):
    appender = ChatAppender(tokenizer, tools=list(toolbox.schemas.values()))
    parser = HermesToolCallParser()
    budget = EpisodeBudget(max_turns, max_episode_tokens, max_model_len, max_prompt_tokens=2048)
    return EpisodeRunner(engine, tokenizer, appender, lambda: ToolEnvironment(toolbox, parser), budget,
                         step_timeout_s=10.0, toolbox=toolbox), appender


def run_with_tools(toolbox, coroutine_fn):
    async def scenario():
        await toolbox.start()
        try:
            return await coroutine_fn()
        finally:
            await toolbox.close()

    return asyncio.run(scenario())


def test_each_turn_sends_the_last_turns_tokens_plus_the_appended_ones(tokenizer, toolbox):
    engine = ScriptedEngine(tokenizer, [(f"let me add {call('add', a=2, b=3)}", "stop"),
                                        (call("add", a=5, b=10), "stop"), ("the answer is 5", "stop")])
    runner, appender = runner_for(tokenizer, toolbox, engine)
    episode = run_with_tools(toolbox, lambda: runner.run(ROW, SAMPLING))
    assert episode.finish_reason == "stop" and episode.turns == 3 and episode.tool_calls == 2
    assert episode.last_text == "the answer is 5"
    prompt = appender.prompt_ids(ROW.messages)
    assert engine.requests[0] == prompt and episode.prompt_len == len(prompt)
    for k in (1, 2):
        appended = appender.append_ids([{"role": "tool", "name": "add", "tool_call_id": "call_0",
                                         "content": ("5", "15")[k - 1]}])
        assert engine.requests[k] == engine.requests[k - 1] + engine.sampled[k - 1] + appended, f"turn {k}"
    assert episode.sequence == engine.requests[2] + engine.sampled[2]
    # model tokens train, with the engine's logprobs and versions; the tool's tokens do not
    mask = np.asarray(episode.loss_mask)
    model_tokens = sum(len(ids) for ids in engine.sampled)
    assert mask.sum() == model_tokens and len(mask) == len(episode.sequence) - len(prompt)
    assert episode.env_tokens == len(mask) - model_tokens > 0
    after = episode.sequence[len(prompt):]
    first_tool = len(engine.sampled[0])
    assert tokenizer.decode(after[first_tool:first_tool + episode.env_tokens // 2]).startswith("\n<|im_start|>tool\n5")
    assert all(lp == -0.25 for lp, m in zip(episode.logprobs, mask) if m)
    assert all(lp == 0.0 and v == -1 for lp, v, m in zip(episode.logprobs, episode.versions, mask) if not m)


def test_budgets_end_episodes_with_the_reason(tokenizer, toolbox):
    always_calls = [(call("add", a=1, b=1), "stop")] * 10
    cases = {
        "max_turns": dict(turns=always_calls, max_turns=3),
        "length": dict(turns=[(call("add", a=1, b=1), "stop"), ("and so on and", "length")], max_turns=5),
        "max_episode_tokens": dict(turns=always_calls, max_turns=10, max_episode_tokens=120),
    }
    for reason, case in cases.items():
        engine = ScriptedEngine(tokenizer, case["turns"])
        runner, _ = runner_for(tokenizer, toolbox, engine, max_turns=case["max_turns"],
                               max_episode_tokens=case.get("max_episode_tokens", 0))
        episode = run_with_tools(toolbox, lambda: runner.run(ROW, SAMPLING))
        assert episode.finish_reason == reason, (reason, episode.finish_reason)
        assert episode.after_prompt() <= case.get("max_episode_tokens", 10**6)
    assert episode.turns < 10


def test_tools_that_fail_answer_the_model_with_the_error_and_the_episode_goes_on(tokenizer, toolbox):
    engine = ScriptedEngine(tokenizer, [
        (call("broken", x=1) + call("slow", x=1), "stop"),
        (call("chatty", x=1) + call("mul", a=1) + '<tool_call>{"name": "add"</tool_call>' + call("add", a="x", b=1),
         "stop"),
        ("5", "stop")])
    runner, _ = runner_for(tokenizer, toolbox, engine)
    episode = run_with_tools(toolbox, lambda: runner.run(ROW, SAMPLING))
    assert episode.finish_reason == "stop" and episode.turns == 3 and episode.tool_calls == 6
    seen = tokenizer.decode(episode.sequence)
    assert "error: broken failed: RuntimeError: the calculator is on fire" in seen
    assert "error: slow did not finish within 1 s" in seen
    assert "error: chatty returned 50000 characters, more than the 200" in seen
    assert "there is no tool 'mul'" in seen and "not valid JSON" in seen and "must be integer, got str" in seen
    metrics = runner.metrics()
    for reason in ("error", "timeout", "output_too_long", "unknown_tool", "malformed", "bad_arguments"):
        assert metrics[f"rollout/tool_errors/{reason}"] == 1.0, reason
    assert metrics["timing/tool/slow_s"] >= 1.0


class FlakyEnv:
    """Opens with its own system prompt; its step raises on 'boom' and hangs on 'hang'; rewards 'win' 1.0."""

    async def reset(self, row):
        return [{"role": "system", "content": "play"}, *row["prompt"]]

    async def step(self, text):
        if text == "boom":
            raise KeyError("lost the board")
        if text == "hang":
            await asyncio.sleep(60)
        if text == "win":
            return StepResult(reward=1.0, done=True, info={"moves": 2})
        if text == "dict":
            return {"messages": [], "done": True}
        if text == "garbage":
            return StepResult(messages=[{"role": "user", "content": {"not": "text"}}])
        if text == "string":
            return StepResult(messages="again")
        return StepResult(messages=[{"role": "user", "content": "again"}], reward=0.25)


def test_a_failing_environment_ends_its_episode_and_is_counted(tokenizer):
    appender = ChatAppender(tokenizer)

    async def run(turns):
        engine = ScriptedEngine(tokenizer, turns)
        runner = EpisodeRunner(engine, tokenizer, appender, FlakyEnv, EpisodeBudget(4, 0, 4096, 2048),
                               step_timeout_s=0.5)
        return await runner.run(ROW, SAMPLING), runner

    won, _ = asyncio.run(run([("move", "stop"), ("win", "stop")]))
    assert won.finish_reason == "stop" and won.rewards == [0.25, 1.0] and won.info == {"moves": 2}
    assert tokenizer.decode(won.sequence).startswith("<|im_start|>system\nplay")
    broken, runner = asyncio.run(run([("boom", "stop")]))
    assert (broken.finish_reason, broken.env_error) == ("env_error", "error")
    hung, runner = asyncio.run(run([("move", "stop"), ("hang", "stop")]))
    assert (hung.finish_reason, hung.env_error) == ("env_error", "timeout")
    assert runner.metrics() == {"rollout/env_errors/timeout": 1.0}
    for text, reason in (("dict", "bad_result"), ("garbage", "bad_messages"), ("string", "bad_messages")):
        episode, runner = asyncio.run(run([(text, "stop")]))
        assert (episode.finish_reason, episode.env_error) == ("env_error", reason), text
        assert runner.metrics() == {f"rollout/env_errors/{reason}": 1.0}


def test_environment_classes_are_loaded_from_a_file_and_must_be_async(tmp_path):
    from asyncrl.generator.agents.environment import EnvironmentLoadError, load_environment_class

    path = tmp_path / "envs.py"
    path.write_text("class Good:\n    async def reset(self, row):\n        return None\n"
                    "    async def step(self, text):\n        return None\n"
                    "class Sync:\n    async def reset(self, row):\n        return None\n"
                    "    def step(self, text):\n        return None\n")
    assert load_environment_class(str(path), "Good").__name__ == "Good"
    with pytest.raises(EnvironmentLoadError, match="Sync.step must be an `async def`"):
        load_environment_class(str(path), "Sync")
    with pytest.raises(EnvironmentLoadError, match="not a class"):
        load_environment_class(str(path), "Missing")
    with pytest.raises(EnvironmentLoadError, match="does not exist"):
        load_environment_class(str(tmp_path / "none.py"), "Good")


def test_templates_that_cannot_append_are_refused_with_the_reason():
    last_only = "{{ messages[-1]['content'] }}<|im_end|>"  # drops history: every turn rewrites the past
    with pytest.raises(TemplateCannotAppend, match="changes the earlier part"):
        ChatAppender(chat_tokenizer(last_only))
    no_end = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    with pytest.raises(TemplateCannotAppend, match="not with the stop token"):
        ChatAppender(chat_tokenizer(no_end))
    without = chat_tokenizer()
    without.chat_template = None
    with pytest.raises(TemplateCannotAppend, match="no chat template"):
        ChatAppender(without)


def test_an_opening_longer_than_the_prompt_budget_is_refused(tokenizer, toolbox):
    runner, _ = runner_for(tokenizer, toolbox, ScriptedEngine(tokenizer, []))
    runner.budget = EpisodeBudget(4, 0, 4096, max_prompt_tokens=20)  # the tools' schemas alone are longer
    with pytest.raises(PromptTooLong, match="data.max_prompt_tokens=20"):
        asyncio.run(runner.run(ROW, SAMPLING))


def test_episodes_that_open_differently_share_the_common_prefix_as_the_prompt():
    from asyncrl.generator.agents.episode import Episode

    a = Episode(prompt_len=4, sequence=[1, 2, 3, 4, 9, 9], logprobs=[-1.0, -1.0], versions=[5, 6], loss_mask=[1, 1])
    b = Episode(prompt_len=3, sequence=[1, 2, 7, 8, 5, 8], logprobs=[-1.0, 0.0, -1.0], versions=[3, -1, 4],
                loss_mask=[1, 0, 1])
    prompt, (sa, sb) = episodes_to_samples([a, b], [1.0, 0.0], [{}, {}])
    assert prompt.tolist() == [1, 2]
    assert sa.completion_ids.tolist() == [3, 4, 9, 9] and sa.loss_mask.tolist() == [0, 0, 1, 1]
    assert sa.versions.tolist() == [5, 5, 5, 6] and sa.logprobs.tolist() == [0.0, 0.0, -1.0, -1.0]
    assert sb.completion_ids.tolist() == [7, 8, 5, 8] and sb.loss_mask.tolist() == [0, 1, 0, 1]
    assert sb.versions.tolist() == [3, 3, 3, 4]  # environment tokens take the first model token's version


class CallThenAnswerEngine(ScriptedEngine):
    """The four episodes run concurrently, so turns are chosen by the request: no tool result yet, call the tool;
    else the next answer."""

    def __init__(self, tokenizer, answers):
        super().__init__(tokenizer, [])
        self.answers = list(answers)

    async def sample(self, prompt_ids, sampling, n):
        first_turn = "<|im_start|>tool" not in self.tokenizer.decode(prompt_ids)
        self.turns = [(call("add", a=2, b=3), "stop") if first_turn else (self.answers.pop(0), "stop")]
        return await super().sample(prompt_ids, sampling, n)


def test_a_group_of_tool_episodes_through_the_rollout_loop(tokenizer, toolbox):
    engine = CallThenAnswerEngine(tokenizer, ["5", "6", "5", "7"])
    runner, appender = runner_for(tokenizer, toolbox, engine)
    loop = RolloutLoop(client=None, engine=engine, prompts=iter([]), scorer=InlineScorer(), tokenizer=tokenizer,
                       rollout_cfg=RolloutConfig(n=4, max_tokens=64, max_turns=4), max_inflight_groups=1,
                       generator_id="g", reward_shaping=RewardConfig(), episodes=runner)
    group = run_with_tools(toolbox, lambda: loop.sampler.sample(ROW))
    assert group.prompt_ids.tolist() == appender.prompt_ids(ROW.messages)
    assert sorted(sample.reward for sample in group.samples) == [0.0, 0.0, 1.0, 1.0]
    assert all(sample.loss_mask is not None and 0 < sample.loss_mask.sum() < len(sample.loss_mask)
               for sample in group.samples)
    assert group.min_version() == 7
    metrics = loop.stats.snapshot(7)
    assert metrics["rollout/turns/mean"] == 2.0 and metrics["rollout/tool_calls/mean"] == 1.0
    assert metrics["rollout/tool_use_frac"] == 1.0 and metrics["rollout/env_tokens/mean"] > 0
    assert "timing/tool/add_s" in metrics
    quiet = loop.stats.snapshot(7)  # a window in which no episode finished repeats the last window's means
    assert quiet["rollout/turns/mean"] == 2.0 and quiet["rollout/tool_use_frac"] == 1.0


def test_the_recipe_builds_the_tool_environment_or_the_users_class(tokenizer, tmp_path):
    from asyncrl.configs import load_config
    from asyncrl.generator.agents.build import build_episode_runner, wants_episodes

    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS)
    env = tmp_path / "env.py"
    env.write_text("class E:\n    async def reset(self, row):\n        return None\n"
                   "    async def step(self, text):\n        return None\n")
    for overrides, kind in (([f"tools.functions=[{tools}:add,{tools}:slow]"], ToolEnvironment),
                            ([f"env.path={env}", "env.name=E"], None)):
        cfg = load_config(None, [*overrides, "rollout.max_turns=3", "rollout.max_episode_tokens=200"])
        default = load_config()
        assert wants_episodes(cfg.tools, cfg.env, cfg.agent)
        assert not wants_episodes(default.tools, default.env, default.agent)
        runner = build_episode_runner(cfg.tools, cfg.env, cfg.agent, cfg.rollout, max_model_len=512,
                                      max_prompt_tokens=400,
                                      tool_workers=1, engine=None, tokenizer=tokenizer)
        assert runner.budget == EpisodeBudget(3, 200, 512, 400)
        if kind is ToolEnvironment:
            assert sorted(runner.toolbox.schemas) == ["add", "slow"] and isinstance(runner.make_env(), kind)
            assert '"name": "add"' in tokenizer.decode(runner.appender.prompt_ids(ROW.messages))
        else:
            assert runner.toolbox is None and runner.make_env().__class__.__name__ == "E"
