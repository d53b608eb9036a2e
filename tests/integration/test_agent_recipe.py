"""The agent recipe's agent (examples/agent/agent.py) against the generator's real OpenAI-compatible endpoint, with
the recipe's own tokenizer and chat template and a scripted model: each tool call reaches the agent as `tool_calls`,
the agent runs the tool and sends the result back, and the episode's tokens are exactly the SFT transcript's of the
same conversation: the warm start showed the model the prompt the agent makes. (The recipe as a job:
tests/e2e/test_agent_recipe.py.)"""
import asyncio
import os

import pytest

from asyncrl.buffer.group import Sampling
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.agents.episode import EpisodeBudget
from asyncrl.generator.agents.openai_agent import OpenAIAgentRunner, load_agent_function
from asyncrl.generator.agents.openai_server import OpenAIEndpoint
from asyncrl.generator.tasks import add_subtract
from asyncrl.launch.demo import train_char_tokenizer
from tests.scripted_engine import ScriptedEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLING = Sampling(1.0, 1.0, -1, 40)
BUDGET = EpisodeBudget(max_turns=3, max_episode_tokens=0, max_model_len=256, max_prompt_tokens=48)


@pytest.fixture(scope="module")
def tokenizer():
    return train_char_tokenizer(add_subtract, add_subtract.tokenizer_corpus(0))


def play(tokenizer, prompt: str, truth: str, turns):
    engine = ScriptedEngine(tokenizer, turns)
    endpoint = OpenAIEndpoint(engine, "asyncrl", SAMPLING)
    agent = load_agent_function(os.path.join(ROOT, "examples", "agent", "agent.py"), "episode")
    row = PromptRow("p0", [1], add_subtract.DATA_SOURCE, truth, {}, messages=[{"role": "user", "content": prompt}])

    async def run():
        await endpoint.start()
        try:
            runner = OpenAIAgentRunner(endpoint, agent, tokenizer, BUDGET, max_tokens=40, timeout_s=30)
            return await runner.run(row, SAMPLING), runner.metrics()
        finally:
            await endpoint.close()

    return asyncio.run(run())


@pytest.mark.parametrize("op,a,b", [("add", 1234, 3678), ("sub", 7345, 2111)])
def test_each_tool_round_trips_and_the_episode_is_the_sft_transcript(tokenizer, op, a, b):
    name, result = add_subtract.OPERATIONS[op][0], a + b if op == "add" else a - b
    prompt = add_subtract.prompt_text(op, a, b)
    episode, metrics = play(tokenizer, prompt, str(result),
                            [(add_subtract.call_text(name, a, b), "stop"), (str(result), "stop")])
    assert metrics == {}  # nothing refused, no agent failure, no bad call
    assert episode.rewards == [1.0] and episode.turns == 2 and episode.tool_calls == 1
    call = add_subtract.call_text(name, a, b)
    transcript = [{"role": "user", "content": prompt}, {"role": "assistant", "content": call},
                  {"role": "tool", "content": str(result)}, {"role": "assistant", "content": str(result)}]
    rendered = tokenizer.apply_chat_template(transcript, tools=add_subtract.tools(), tokenize=False)
    assert tokenizer.decode(episode.sequence) + "\n" == rendered


def test_the_wrong_tool_gives_the_agent_a_wrong_result_and_scores_zero(tokenizer):
    episode, metrics = play(tokenizer, "sub:7345-2111=", "5234",
                            [(add_subtract.call_text("add", 7345, 2111), "stop"), ("9456", "stop")])
    assert metrics == {} and episode.tool_calls == 1 and episode.rewards == [0.0]


def test_a_turn_cut_after_a_whole_call_says_length_so_the_agent_stops_there(tokenizer):
    """A call the model closed before max_tokens cut its turn: the reply says `length`, as OpenAI's does, not
    `tool_calls`, which would send the agent on to a request the endpoint must refuse (after_cut)."""
    episode, metrics = play(tokenizer, "add:1234+3678=", "4912",
                            [(add_subtract.call_text("add", 1234, 3678) + "49", "length")])
    assert metrics == {} and not episode.env_error, metrics
    assert episode.turns == 1 and episode.rewards == [0.0] and episode.finish_reason == "length"
