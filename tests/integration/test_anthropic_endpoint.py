"""The endpoint's Anthropic Messages API (`POST /v1/messages`), driven by the official `anthropic` client: an agent
written against `anthropic.AsyncAnthropic` with a tool_use / tool_result round trip is recorded as the same one
token sequence an OpenAI agent's conversation is; a streamed reply arrives as Anthropic's events and adds up to the
plain reply; an edited history, an unknown or missing key and a bad max_tokens are refused as Anthropic error
objects and counted by cause. The engine is scripted (the vLLM stream: test_anthropic_vllm.py)."""
import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from asyncrl.buffer.group import Sampling
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.agents.episode import EpisodeBudget
from asyncrl.generator.agents.openai_agent import OpenAIAgentRunner
from asyncrl.generator.agents.openai_server import OpenAIEndpoint
from asyncrl.generator.agents.openai_session import AgentSession
from tests.chat_tokenizer import chat_tokenizer
from tests.scripted_engine import ScriptedEngine, StreamingScriptedEngine, call

ADD = {"name": "add", "description": "Add two integers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
OPENAI_ADD = {"type": "function", "function": {"name": "add", "description": ADD["description"],
                                               "parameters": ADD["input_schema"]}}
SAMPLING = Sampling(1.0, 1.0, -1, 128)
BUDGET = EpisodeBudget(max_turns=4, max_episode_tokens=0, max_model_len=4096, max_prompt_tokens=2048)
SYSTEM = "You add numbers."
ROW = PromptRow("p0", [1], "t", "5", {}, messages=[{"role": "user", "content": "what is 2+3?"}])
TURNS = [(f"adding {call('add', a=2, b=3)}", "stop"), ("5", "stop")]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


async def anthropic_agent(row, anthropic_client):
    """An agent as Anthropic's docs write one: send the reply's content back, answer each tool_use."""
    messages = list(row["prompt"])
    for _ in range(3):
        reply = await anthropic_client.messages.create(model="asyncrl", max_tokens=64, system=SYSTEM,
                                                       messages=messages, tools=[ADD])
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            return float(reply.content[0].text.strip() == row["ground_truth"])
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": str(block.input["a"] + block.input["b"])}
            for block in reply.content if block.type == "tool_use"]})
    return 0.0


async def openai_agent(row, client):
    """The same conversation written against the OpenAI API."""
    messages = [{"role": "system", "content": SYSTEM}, *row["prompt"]]
    for _ in range(3):
        reply = (await client.chat.completions.create(model="asyncrl", max_tokens=64, messages=messages,
                                                      tools=[OPENAI_ADD])).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return float(reply.content.strip() == row["ground_truth"])
        for tool_call in reply.tool_calls:
            arguments = json.loads(tool_call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": str(arguments["a"] +
                                                                                          arguments["b"])})
    return 0.0


def serve(tokenizer, turns, scenario, engine_class=ScriptedEngine):
    """Run `scenario(endpoint, engine)` with the endpoint serving a scripted engine."""
    engine = engine_class(tokenizer, turns)
    endpoint = OpenAIEndpoint(engine, "asyncrl", SAMPLING)

    async def run():
        await endpoint.start()
        try:
            return await scenario(endpoint, engine)
        finally:
            await endpoint.close()

    return asyncio.run(run()), engine


def run_agent(tokenizer, agent):
    async def scenario(endpoint, engine):
        runner = OpenAIAgentRunner(endpoint, agent, tokenizer, BUDGET, max_tokens=128, timeout_s=30)
        return await runner.run(ROW, SAMPLING), runner.metrics()

    return serve(tokenizer, TURNS, scenario)


def test_an_anthropic_agent_with_tool_use_is_one_token_sequence_as_an_openai_agent_is(tokenizer):
    """The runner hands a function that takes `anthropic_client` an AsyncAnthropic client; its tool_use /
    tool_result round trip makes the second request the first's tokens, the sampled tokens and the tool result,
    and the whole episode is token for token the one the same conversation through the OpenAI API makes."""
    (episode, metrics), engine = run_agent(tokenizer, anthropic_agent)
    (twin, _), twin_engine = run_agent(tokenizer, openai_agent)
    assert metrics == {} and episode.env_error == ""
    assert episode.rewards == [1.0] and episode.turns == 2 and episode.tool_calls == 1
    assert engine.requests[1][:len(engine.requests[0]) + len(engine.sampled[0])] == \
        engine.requests[0] + engine.sampled[0]
    assert tokenizer.decode(engine.requests[1][len(engine.requests[0]) + len(engine.sampled[0]):]) == \
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert episode.sequence == engine.requests[1] + engine.sampled[1]
    assert sum(episode.loss_mask) == len(engine.sampled[0]) + len(engine.sampled[1])
    assert engine.requests == twin_engine.requests and episode.sequence == twin.sequence
    assert episode.loss_mask == twin.loss_mask
    first = tokenizer.decode(engine.requests[0])
    assert '"name": "add"' in first and "You add numbers." in first


def test_a_plain_reply_is_a_message_with_text_and_tool_use_blocks(tokenizer):
    async def scenario(endpoint, engine):
        endpoint.sessions["k1"] = AgentSession("k1", tokenizer, BUDGET, max_tokens=128)
        async with anthropic.AsyncAnthropic(base_url=endpoint.url.removesuffix("/v1"), api_key="k1",
                                            max_retries=0) as client:
            return await client.messages.create(model="asyncrl", max_tokens=64, messages=ROW.messages, tools=[ADD])

    reply, engine = serve(tokenizer, TURNS, scenario)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "asyncrl"
    assert reply.id.startswith("msg_") and reply.stop_reason == "tool_use" and reply.stop_sequence is None
    assert [block.type for block in reply.content] == ["text", "tool_use"] and reply.content[0].text == "adding"
    assert (reply.content[1].name, reply.content[1].input) == ("add", {"a": 2, "b": 3})
    assert reply.usage.input_tokens == len(engine.requests[0])
    assert reply.usage.output_tokens == len(engine.sampled[0])


def test_a_stream_is_anthropics_events_and_adds_up_to_the_plain_reply(tokenizer):
    """Token by token from a streaming engine: several text deltas, the tool call as a tool_use block after the
    text with its input in input_json_delta, and a final message equal to the one a plain request answers (but
    its id); the content sent back is accepted and the episode holds the engine's tokens."""
    async def scenario(endpoint, engine):
        for key in ("plain-episode", "streamed-episode"):  # the same last 8 characters: the same tool_use ids
            endpoint.sessions[key] = AgentSession(key, tokenizer, BUDGET, max_tokens=128)
        out = {}
        async with anthropic.AsyncAnthropic(base_url=endpoint.url.removesuffix("/v1"), api_key="plain-episode",
                                            max_retries=0) as client:
            out["plain"] = await client.messages.create(model="asyncrl", max_tokens=64, messages=ROW.messages,
                                                        tools=[ADD])
        async with anthropic.AsyncAnthropic(base_url=endpoint.url.removesuffix("/v1"), api_key="streamed-episode",
                                            max_retries=0) as client:
            async with client.messages.stream(model="asyncrl", max_tokens=64, messages=ROW.messages,
                                              tools=[ADD]) as stream:
                out["events"] = [event async for event in stream]
                out["streamed"] = await stream.get_final_message()
            messages = [*ROW.messages, {"role": "assistant", "content": out["streamed"].content},
                        {"role": "user", "content": [{"type": "tool_result", "content": [{"type": "text", "text": "5"}],
                                                      "tool_use_id": out["streamed"].content[1].id}]}]
            async with client.messages.stream(model="asyncrl", max_tokens=64, messages=messages,
                                              tools=[ADD]) as stream:
                out["texts"] = [text async for text in stream.text_stream]
                out["last"] = await stream.get_final_message()
        return out, endpoint.sessions["streamed-episode"].episode

    turns = [TURNS[0], TURNS[0], ("the sum is 5", "stop")]
    (out, episode), engine = serve(tokenizer, turns, scenario, StreamingScriptedEngine)
    kinds = [event.type for event in out["events"]]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [event.delta for event in out["events"] if event.type == "content_block_delta"]
    assert len([delta for delta in deltas if delta.type == "text_delta"]) > 1
    assert [json.loads(delta.partial_json) for delta in deltas if delta.type == "input_json_delta"] == [
        {"a": 2, "b": 3}]
    plain, streamed = out["plain"].model_dump(), out["streamed"].model_dump()
    assert streamed.pop("id") != plain.pop("id") and streamed == plain
    assert len(out["texts"]) > 1 and "".join(out["texts"]) == "the sum is 5"
    assert out["last"].stop_reason == "end_turn" and out["last"].content[0].text == "the sum is 5"
    assert out["last"].usage.output_tokens == len(engine.sampled[2])
    assert episode.sequence == engine.requests[2] + engine.sampled[2]
    model_tokens = [token for token, mask in zip(episode.sequence[episode.prompt_len:], episode.loss_mask) if mask]
    assert model_tokens == engine.sampled[1] + engine.sampled[2]


def test_requests_the_episode_cannot_take_are_refused_as_anthropic_errors_and_counted(tokenizer):
    """An edited history gets the OpenAI path's cause and reason; an unknown or missing key 401; max_tokens <= 0,
    stop_sequences and an image 400; each counted in rollout/http_refusals/<cause>, and the episode goes on."""
    async def scenario(endpoint, engine):
        endpoint.sessions["k2"] = AgentSession("k2", tokenizer, BUDGET, max_tokens=128)
        root = endpoint.url.removesuffix("/v1")
        client = anthropic.AsyncAnthropic(base_url=root, api_key="k2", max_retries=0)
        stranger = anthropic.AsyncAnthropic(base_url=root, api_key="nobody", max_retries=0)
        errors = {}
        try:
            first = await client.messages.create(model="asyncrl", max_tokens=64, messages=ROW.messages)
            reply = {"role": "assistant", "content": first.content}
            then = {"role": "user", "content": "and?"}
            create = client.messages.create
            image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
            for name, request in (
                    ("edited", create(model="asyncrl", max_tokens=64, messages=[
                        *ROW.messages, {"role": "assistant", "content": "something else"}, then])),
                    ("omitted", create(model="asyncrl", max_tokens=64, messages=[*ROW.messages, then])),
                    ("stranger", stranger.messages.create(model="asyncrl", max_tokens=64, messages=ROW.messages)),
                    ("zero", create(model="asyncrl", max_tokens=0, messages=[*ROW.messages, reply, then])),
                    ("negative", create(model="asyncrl", max_tokens=-5, messages=[*ROW.messages, reply, then])),
                    ("stop", create(model="asyncrl", max_tokens=64, stop_sequences=["\n"],
                                    messages=[*ROW.messages, reply, then])),
                    ("image", create(model="asyncrl", max_tokens=64, messages=[
                        *ROW.messages, reply, {"role": "user", "content": [image]}]))):
                try:
                    await request
                except anthropic.APIStatusError as err:
                    errors[name] = (err.status_code, err.body["error"]["type"], err.body["error"]["cause"],
                                    err.body["error"]["message"])
            async with httpx.AsyncClient() as raw:  # no key at all
                missing = await raw.post(f"{root}/v1/messages", json={"model": "asyncrl", "max_tokens": 8,
                                                                      "messages": ROW.messages})
            second = await create(model="asyncrl", max_tokens=64, messages=[*ROW.messages, reply, then])
        finally:
            await client.close()
            await stranger.close()
        return errors, (missing.status_code, missing.json()), second, endpoint.metrics()

    (errors, missing, second, metrics), _ = serve(tokenizer, [("4", "stop"), ("5", "stop")], scenario)
    assert errors["edited"][:3] == (400, "invalid_request_error", "history_edited")
    assert ("messages[1] (assistant) differs from the reply this episode's turn 1 returned: expected {role "
            "'assistant', content '4'}, got {role 'assistant', content 'something else'}") in errors["edited"][3]
    assert errors["omitted"][:3] == (400, "invalid_request_error", "reply_omitted")
    assert errors["stranger"][:3] == (401, "authentication_error", "unknown_key")
    assert missing[0] == 401 and missing[1]["type"] == "error"
    assert missing[1]["error"]["type"] == "authentication_error"
    assert errors["zero"][:3] == (400, "invalid_request_error", "bad_parameter")
    assert "max_tokens is required and must be a positive integer, got 0" in errors["zero"][3]
    assert errors["negative"][:3] == (400, "invalid_request_error", "bad_parameter")
    assert errors["stop"][2] == "bad_parameter" and "stop_sequences" in errors["stop"][3]
    assert errors["image"][2] == "bad_messages" and "'image' block" in errors["image"][3]
    assert second.content[0].text == "5"
    assert metrics == {"rollout/http_refusals/bad_messages": 1.0, "rollout/http_refusals/bad_parameter": 3.0,
                       "rollout/http_refusals/history_edited": 1.0, "rollout/http_refusals/reply_omitted": 1.0,
                       "rollout/http_refusals/unknown_key": 2.0}


def test_an_anthropic_agent_that_lets_a_refusal_escape_is_counted_as_refused(tokenizer):
    async def stubborn(row, anthropic_client):
        await anthropic_client.messages.create(model="asyncrl", max_tokens=0, messages=row["prompt"])

    async def scenario(endpoint, engine):
        runner = OpenAIAgentRunner(endpoint, stubborn, tokenizer, BUDGET, max_tokens=128, timeout_s=5)
        episode = await runner.run(ROW, SAMPLING)
        return episode.env_error, runner.metrics()

    result, _ = serve(tokenizer, [], scenario)
    assert result == ("agent_refused", {"rollout/env_errors/agent_refused": 1.0,
                                        "rollout/http_refusals/bad_parameter": 1.0})


class FailingStreamEngine(StreamingScriptedEngine):
    """Streams two tokens of its first turn, then fails as a broken engine would."""

    async def sample_stream(self, prompt_ids, sampling):
        index = 0
        async for completion in super().sample_stream(prompt_ids, sampling):
            if index == 2 and len(self.requests) == 1:
                raise RuntimeError("the engine broke")
            index += 1
            yield completion


def test_a_broken_tool_call_says_so_and_a_failed_stream_is_an_error_event(tokenizer):
    """A reply whose only tool call is malformed has stop_reason "malformed_tool_call" (counted in
    rollout/tool_errors); an engine failing mid-stream ends the stream with Anthropic's error event, which the
    official client raises, and the same request sent again is answered."""
    async def scenario(endpoint, engine):
        endpoint.sessions["k3"] = AgentSession("k3", tokenizer, BUDGET, max_tokens=128)
        async with anthropic.AsyncAnthropic(base_url=endpoint.url.removesuffix("/v1"), api_key="k3",
                                            max_retries=0) as client:
            with pytest.raises(anthropic.APIStatusError, match="the engine broke"):
                async with client.messages.stream(model="asyncrl", max_tokens=64, messages=ROW.messages,
                                                  tools=[ADD]) as stream:
                    [event async for event in stream]
            broken = await client.messages.create(model="asyncrl", max_tokens=64, messages=ROW.messages,
                                                  tools=[ADD])
        return broken, endpoint.metrics()

    text = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    (broken, metrics), _ = serve(tokenizer, [("the sum is", "stop"), (text, "stop")], scenario, FailingStreamEngine)
    assert broken.stop_reason == "malformed_tool_call" and [block.text for block in broken.content] == [text]
    assert metrics == {"rollout/tool_errors/malformed": 1.0}
