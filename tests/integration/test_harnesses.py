"""Agent harnesses people already use, unmodified (examples/openai_agents_sdk, examples/langgraph, an agent written
against the `anthropic` client, examples/anthropic_client, through /v1/messages, and examples/verifiers: a verifiers
environment played by its built-in `null` harness), against the generator's real endpoint with a scripted model:
the model's tool calls reach the harness, the harness runs its own tools and sends their results back with the whole
history, and the episode is one token sequence, nothing re-tokenized, that the endpoint never refused. (A job with
each, through to the learner:
tests/e2e/test_harnesses.py.)"""
import asyncio
import os

import pytest

from asyncrl.buffer.group import Sampling
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.agents.episode import EpisodeBudget
from asyncrl.generator.agents.openai_agent import OpenAIAgentRunner, load_agent_function
from asyncrl.generator.agents.openai_server import OpenAIEndpoint
from tests.chat_tokenizer import chat_tokenizer
from tests.scripted_engine import ScriptedEngine, call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESSES = {"openai_agents_sdk": "agents", "langgraph": "langgraph", "anthropic_client": "anthropic",
             "verifiers": "verifiers.v1"}
"""Example folder -> the module the harness is imported as (skipped where it is not installed)."""
SAMPLING = Sampling(1.0, 1.0, -1, 512)
BUDGET = EpisodeBudget(max_turns=3, max_episode_tokens=0, max_model_len=4096, max_prompt_tokens=2048)
ROW = PromptRow("p0", [1], "t", "4912", {}, messages=[{"role": "user", "content": "add:1234+3678="}])


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def run_episode(tokenizer, example, turns):
    """One episode of the example's agent function against the endpoint; (episode, metrics, engine)."""
    pytest.importorskip(HARNESSES[example])
    return serve_agent(tokenizer, load_agent_function(os.path.join(ROOT, "examples", example, "agent.py"), "episode"),
                       turns)


def serve_agent(tokenizer, episode_fn, turns, budget=BUDGET):
    engine = ScriptedEngine(tokenizer, turns)
    endpoint = OpenAIEndpoint(engine, "asyncrl", SAMPLING)

    async def run():
        await endpoint.start()
        try:
            runner = OpenAIAgentRunner(endpoint, episode_fn, tokenizer, budget, max_tokens=512, timeout_s=30)
            return await runner.run(ROW, SAMPLING), runner.metrics()
        finally:
            await endpoint.close()

    episode, metrics = asyncio.run(run())
    return episode, metrics, engine


@pytest.mark.parametrize("example", sorted(HARNESSES))
def test_a_harness_runs_its_tools_and_its_episode_is_one_token_sequence(tokenizer, example):
    turns = [(call("calculator", expression="1234+3678") + call("digit_count", number=4912), "stop"), ("4912", "stop")]
    episode, metrics, engine = run_episode(tokenizer, example, turns)
    assert metrics == {}  # no refusal (history_edited, tools_changed, ...), no agent failure, no bad tool call
    assert not episode.env_error and episode.finish_reason == "stop"
    assert episode.turns == 2 and episode.tool_calls == 2 and episode.rewards == [1.0]
    # the second request is the first, the model's tokens as sampled, and the two tool results the harness sent
    assert engine.requests[1][:len(engine.requests[0]) + len(engine.sampled[0])] == \
        engine.requests[0] + engine.sampled[0]
    appended = tokenizer.decode(engine.requests[1][len(engine.requests[0]) + len(engine.sampled[0]):])
    assert appended == ("\n<|im_start|>tool\n4912<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n"
                        "<|im_start|>assistant\n"), appended
    assert episode.sequence == engine.requests[1] + engine.sampled[1]
    assert sum(episode.loss_mask) == len(engine.sampled[0]) + len(engine.sampled[1])
    assert '"name": "digit_count"' in tokenizer.decode(engine.requests[0])  # the harness's tools reach the template


@pytest.mark.parametrize("example", sorted(HARNESSES))
def test_a_harness_whose_model_never_answers_scores_zero(tokenizer, example):
    """Past its turn limit the harness raises its own error; the example scores that 0 rather than failing."""
    turns = [(call("calculator", expression="1+1"), "stop")] * 3
    episode, metrics, _ = run_episode(tokenizer, example, turns)
    assert not episode.env_error and episode.turns == 3 and episode.rewards == [0.0], metrics


def test_an_agents_sdk_handoff_is_refused_as_tools_changed(tokenizer):
    """docs/agents.md: a handoff switches to an agent with other tools, which one episode cannot take."""
    pytest.importorskip("agents")
    from agents import Agent, OpenAIChatCompletionsModel, Runner

    async def handoff_episode(row, client):
        model = OpenAIChatCompletionsModel(model="asyncrl", openai_client=client)
        helper = Agent(name="helper", instructions="You add.", model=model)
        await Runner.run(Agent(name="adder", handoffs=[helper], model=model), list(row["prompt"]), max_turns=3)
        return 1.0

    episode, metrics, _ = serve_agent(tokenizer, handoff_episode,
                                      [(call("transfer_to_helper"), "stop"), ("4912", "stop")])
    assert episode.env_error == "agent_refused" and episode.turns == 1
    assert metrics == {"rollout/env_errors/agent_refused": 1.0, "rollout/http_refusals/tools_changed": 1.0}


def test_a_verifiers_episode_the_endpoint_refused_is_counted_not_scored(tokenizer):
    """verifiers keeps a failed run as data on its trace (reward 0); the example raises it, so asyncrl counts it."""
    pytest.importorskip("verifiers.v1")
    fn = load_agent_function(os.path.join(ROOT, "examples", "verifiers", "agent.py"), "episode")
    one_turn = EpisodeBudget(max_turns=1, max_episode_tokens=0, max_model_len=4096, max_prompt_tokens=2048)
    episode, metrics, _ = serve_agent(tokenizer, fn, [(call("calculator", expression="1+1"), "stop"), ("2", "stop")],
                                      budget=one_turn)
    assert episode.env_error == "agent_error" and episode.turns == 1 and episode.rewards == []
    assert metrics == {"rollout/env_errors/agent_error": 1.0, "rollout/http_refusals/turn_limit": 1.0}
