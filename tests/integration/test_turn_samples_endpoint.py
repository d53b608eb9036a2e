"""Per-turn samples through the OpenAI endpoint, driven by the official `openai` client, with a chat template that
strips reasoning from earlier turns (tests/reasoning_template.py): each turn's prompt is the template's render of
the request (earlier reasoning gone), exactly the ids the engine was given; each completion is exactly the ids the
engine sampled; the history an agent sends back must still be what it was answered; a failed streamed turn leaves
the session as it was. In `episode` mode the same template is refused at the first request, naming the option.
The group these episodes make passes the buffer's checks and reaches the learner's advantages per episode."""
import asyncio
import json

import openai
import pytest

from asyncrl.algos.config import AlgoConfig
from asyncrl.algos.offpolicy_plan import OffPolicyPlan
from asyncrl.buffer.codec import decode_group, encode_group
from asyncrl.buffer.group import Group, Sampling
from asyncrl.buffer.plausibility import JobLimits
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.agents.chat_render import ChatRenderer
from asyncrl.generator.agents.episode import EpisodeBudget, episodes_to_samples
from asyncrl.generator.agents.openai_agent import OpenAIAgentRunner
from asyncrl.generator.agents.openai_server import OpenAIEndpoint
from asyncrl.generator.agents.openai_session import AgentSession
from asyncrl.learner.batch import build_batch
from asyncrl.learner.train_step import compute_advantages, episode_rows
from tests.reasoning_template import reasoning_tokenizer
from tests.scripted_engine import ScriptedEngine, call

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
SAMPLING = Sampling(1.0, 1.0, -1, 128)
BUDGET = EpisodeBudget(max_turns=4, max_episode_tokens=0, max_model_len=4096, max_prompt_tokens=2048)
ROW = PromptRow("p0", [1], "t", "5", {}, messages=[{"role": "user", "content": "what is 2+3?"}])


async def reasoning_agent(row, client):
    """Calls the tool the model asks for, then asks the model to double-check, as a user would."""
    messages = list(row["prompt"])
    response = None
    for follow_up in (None, "are you sure?"):
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        for _ in range(2):
            response = await client.chat.completions.create(model="asyncrl", messages=messages, tools=[ADD])
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for tool_call in message.tool_calls:
                arguments = json.loads(tool_call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": tool_call.id,
                                 "content": str(arguments["a"] + arguments["b"])})
    return float(response.choices[0].message.content.split("</think>")[-1].strip() == row["ground_truth"])


TURNS = [(f"<think>I should add</think>{call('add', a=2, b=3)}", "stop"), ("<think>it said 5</think>5", "stop"),
         ("<think>2+3 is 5, yes</think>5", "stop")]


class FailingEngine(ScriptedEngine):
    """Raises on a request while `fail` is set, as an engine that broke mid-turn."""

    fail = False

    async def sample(self, prompt_ids, sampling, n):
        if self.fail:
            raise RuntimeError("the engine broke")
        return await super().sample(prompt_ids, sampling, n)


def serve(tokenizer, turns, scenario):
    engine = FailingEngine(tokenizer, turns)
    endpoint = OpenAIEndpoint(engine, "asyncrl", SAMPLING)

    async def run():
        await endpoint.start()
        try:
            return await scenario(endpoint, engine)
        finally:
            await endpoint.close()

    return asyncio.run(run()), engine


def test_each_turn_of_an_agent_trains_against_the_prompt_the_model_saw():
    tokenizer = reasoning_tokenizer()

    async def scenario(endpoint, engine):
        runner = OpenAIAgentRunner(endpoint, reasoning_agent, tokenizer, BUDGET, max_tokens=128, timeout_s=30,
                                   per_turn=True)
        return await runner.run(ROW, SAMPLING)

    episode, engine = serve(tokenizer, TURNS, scenario)
    assert episode.rewards == [1.0] and episode.turns == 3 and episode.finish_reason == "stop"
    assert [turn.prompt for turn in episode.turn_samples] == engine.requests
    assert [turn.ids for turn in episode.turn_samples] == engine.sampled
    # the third prompt is the template's render of the conversation: the reasoning of the turns before the last
    # user message is gone (not an append of what the model saw and wrote)
    third = tokenizer.decode(engine.requests[2])
    assert "I should add" not in third and "it said 5" not in third and third.endswith("<|im_start|>assistant\n")
    assert engine.requests[2][:len(engine.requests[1]) + len(engine.sampled[1])] != \
        engine.requests[1] + engine.sampled[1]
    # (this template shows an assistant turn's content only, not its tool_calls: the reasoning before the call)
    history = [*ROW.messages, {"role": "assistant", "content": "<think>I should add</think>"},
               {"role": "tool", "content": "5"}, {"role": "assistant", "content": "<think>it said 5</think>5"},
               {"role": "user", "content": "are you sure?"}]
    assert engine.requests[2] == ChatRenderer(tokenizer, tools=[ADD]).prompt_ids(history)

    # n = 2 episodes (the second: one turn) make a group of 4 per-turn samples the buffer and learner accept
    other, _ = serve(tokenizer, [("<think>guess</think>6", "stop"), ("6", "stop")], scenario)
    prompt, samples = episodes_to_samples([episode, other], [1.0, 0.0], [{}, {}])
    assert [s.episode for s in samples] == [0, 0, 0, 1, 1]
    limits = JobLimits(group_size=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=128,
                       max_completion_tokens=4096, max_prompt_tokens=2048, max_positions=4096, max_turns=4)
    group = decode_group(encode_group(Group("g", "p0", "gen", prompt, samples, SAMPLING, 0.0)),
                         vocab_size=len(tokenizer), max_version=7, max_message_bytes=1 << 20, limits=limits)
    batch = build_batch([group])
    for row, (seen, sampled) in enumerate(zip(engine.requests, engine.sampled)):  # a row per turn of episode 0
        assert batch.input_ids[row, :len(seen) + len(sampled)].tolist() == seen + sampled
        assert int(batch.loss_mask[row].sum()) == len(sampled)
    assert episode_rows([group, group]).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    # the learner's advantages: every turn its episode's, GRPO over the 2 episodes (not the 5 rows): +-1/sqrt(2)
    algo = AlgoConfig()
    advantages, _ = compute_advantages(batch, [group], batch.token_rewards, algo, OffPolicyPlan.from_algo(algo))
    per_row = [float(advantages[row][batch.loss_mask[row].bool()].unique()) for row in range(5)]
    assert per_row == pytest.approx([0.7071] * 3 + [-0.7071] * 2, abs=1e-3)


def test_history_rules_hold_and_a_failed_stream_leaves_the_per_turn_session_as_it_was():
    tokenizer = reasoning_tokenizer()

    async def scenario(endpoint, engine):
        endpoint.sessions["s"] = AgentSession("s", tokenizer, BUDGET, max_tokens=128, per_turn=True)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s", max_retries=0)
        errors = {}
        try:
            first = await client.chat.completions.create(model="asyncrl", messages=ROW.messages)
            reply = first.choices[0].message.model_dump(exclude_none=True)
            then = {"role": "user", "content": "sure?"}
            stripped = {"role": "assistant", "content": "5"}  # a harness that drops the reasoning itself
            try:
                await client.chat.completions.create(model="asyncrl", messages=[*ROW.messages, stripped, then])
            except openai.APIStatusError as err:
                errors["stripped"] = (err.status_code, err.code)
            sequence = list(endpoint.sessions["s"].episode.sequence)
            engine.fail = True  # the next turn's engine call fails: nothing is recorded
            stream = await client.chat.completions.create(model="asyncrl", messages=[*ROW.messages, reply, then],
                                                          stream=True)
            try:
                [chunk async for chunk in stream]
            except openai.APIError as err:
                errors["engine"] = err.message
            unchanged = endpoint.sessions["s"].episode.sequence == sequence
            engine.fail = False
            second = await client.chat.completions.create(model="asyncrl", messages=[*ROW.messages, reply, then])
        finally:
            await client.close()
        return errors, unchanged, second, endpoint.sessions["s"].episode

    (errors, unchanged, second, episode), engine = serve(
        tokenizer, [("<think>2+3</think>5", "stop"), ("<think>yes</think>5", "stop")], scenario)
    assert errors["stripped"] == (400, "history_edited")
    assert "the engine broke" in errors["engine"] and unchanged
    assert second.choices[0].message.content == "<think>yes</think>5"
    assert [turn.prompt for turn in episode.turn_samples] == engine.requests
    assert "<think>2+3</think>" in tokenizer.decode(engine.sampled[0])
    assert "<think>" not in tokenizer.decode(engine.requests[1])  # stripped before the last user message


def test_episode_mode_refuses_a_template_that_strips_reasoning_naming_the_option():
    tokenizer = reasoning_tokenizer()

    async def scenario(endpoint, engine):
        endpoint.sessions["s"] = AgentSession("s", tokenizer, BUDGET, max_tokens=128)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s", max_retries=0)
        try:
            await client.chat.completions.create(model="asyncrl", messages=ROW.messages)
        except openai.APIStatusError as err:
            return err.status_code, err.code, err.message
        finally:
            await client.close()

    (status, code, message), engine = serve(tokenizer, [], scenario)
    assert (status, code) == (400, "cannot_render") and "rollout.turn_samples=per_turn" in message
    assert engine.requests == []


async def anthropic_reasoning_agent(row, anthropic_client):
    """The tool-use loop of Anthropic's docs over the same task: reply content sent back as it came."""
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": ADD["function"]["parameters"]}]
    messages = list(row["prompt"])
    for _ in range(3):
        reply = await anthropic_client.messages.create(model="asyncrl", max_tokens=128, messages=messages,
                                                       tools=tools)
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            text = "".join(block.text for block in reply.content if block.type == "text")
            return float(text.split("</think>")[-1].strip() == row["ground_truth"])
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": str(block.input["a"] + block.input["b"])}
            for block in reply.content if block.type == "tool_use"]})
    return 0.0


def test_an_anthropic_client_agent_trains_per_turn_against_the_prompts_the_model_saw():
    tokenizer = reasoning_tokenizer()

    async def scenario(endpoint, engine):
        runner = OpenAIAgentRunner(endpoint, anthropic_reasoning_agent, tokenizer, BUDGET, max_tokens=128,
                                   timeout_s=30, per_turn=True)
        return await runner.run(ROW, SAMPLING)

    episode, engine = serve(tokenizer, TURNS[:2], scenario)
    assert episode.rewards == [1.0] and episode.turns == 2
    assert [turn.prompt for turn in episode.turn_samples] == engine.requests
    assert [turn.ids for turn in episode.turn_samples] == engine.sampled
    # the second prompt is the template's render of the translated history: the tool_result is a tool message
    history = [*ROW.messages, {"role": "assistant", "content": "<think>I should add</think>"},
               {"role": "tool", "content": "5"}]
    assert engine.requests[1] == ChatRenderer(tokenizer, tools=[ADD]).prompt_ids(history)
