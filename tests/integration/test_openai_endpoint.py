"""The generator's OpenAI-compatible endpoint, driven by the official `openai` package: agent episodes with tool
calls, plain and streamed, recorded as one token sequence with nothing re-tokenized; an agent that edits its
history, asks twice at once, or has no session is refused with the reason; the agent runner turns the
function's return into the episode's reward and its failures into counted env errors. The engine is scripted
(the real engine's logprob parity over multi-turn episodes: tests/integration/test_vllm_engine.py)."""
import asyncio
import json

import openai
import pytest

from asyncrl.buffer.group import Sampling
from asyncrl.generator.agents.episode import EpisodeBudget
from asyncrl.generator.agents.openai_agent import OpenAIAgentRunner
from asyncrl.generator.agents.openai_server import OpenAIEndpoint
from asyncrl.generator.agents.openai_session import AgentSession
from asyncrl.data.prompts import PromptRow
from tests.chat_tokenizer import chat_tokenizer
from tests.scripted_engine import ScriptedEngine, StreamingScriptedEngine, call

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
SAMPLING = Sampling(1.0, 1.0, -1, 128)
BUDGET = EpisodeBudget(max_turns=4, max_episode_tokens=0, max_model_len=4096, max_prompt_tokens=2048)
ROW = PromptRow("p0", [1], "t", "5", {}, messages=[{"role": "user", "content": "what is 2+3?"}])


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


async def add_agent(row, client):
    """An agent as people write them: call the model, run the tools it asks for, send the history back."""
    messages = list(row["prompt"])
    for _ in range(3):
        response = await client.chat.completions.create(model="asyncrl", messages=messages, tools=[ADD])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content.strip() == row["ground_truth"])
        for tool_call in message.tool_calls:
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


def test_an_agent_with_tool_calls_becomes_one_token_sequence(tokenizer):
    async def scenario(endpoint, engine):
        runner = OpenAIAgentRunner(endpoint, add_agent, tokenizer, BUDGET, max_tokens=128, timeout_s=30)
        return await runner.run(ROW, SAMPLING)

    episode, engine = serve(tokenizer, [(f"adding {call('add', a=2, b=3)}", "stop"), ("5", "stop")], scenario)
    assert episode.rewards == [1.0] and episode.turns == 2 and episode.tool_calls == 1
    assert episode.finish_reason == "stop" and episode.last_text == "5"
    appended = [index for index, mask in enumerate(episode.loss_mask) if not mask]
    assert engine.requests[1] == engine.requests[0] + engine.sampled[0] + \
        episode.sequence[episode.prompt_len:][appended[0]:appended[-1] + 1]
    assert tokenizer.decode(engine.requests[1][len(engine.requests[0]) + len(engine.sampled[0]):]) == \
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert episode.sequence == engine.requests[1] + engine.sampled[1]
    assert sum(episode.loss_mask) == len(engine.sampled[0]) + len(engine.sampled[1])
    assert '"name": "add"' in tokenizer.decode(engine.requests[0])  # the request's tools reached the template


def test_streaming_answers_chunks_that_add_up_to_the_answer(tokenizer):
    async def scenario(endpoint, engine):
        session = AgentSession("s1", tokenizer, BUDGET, max_tokens=128)
        endpoint.sessions["s1"] = session
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s1", max_retries=0)
        try:
            models = await client.models.list()
            stream = await client.chat.completions.create(model="asyncrl", messages=ROW.messages, stream=True,
                                                          tools=[ADD])
            chunks = [chunk async for chunk in stream]
            tool_stream = await client.chat.completions.create(
                model="asyncrl", stream=True, tools=[ADD],
                messages=[*ROW.messages, {"role": "assistant", "content": "the sum is"},
                          {"role": "user", "content": "use the tool"}])
            tool_chunks = [chunk async for chunk in tool_stream]
        finally:
            await client.close()
        return models, chunks, tool_chunks

    (models, chunks, tool_chunks), _ = serve(tokenizer, [("the sum is", "stop"), (call("add", a=2, b=3), "stop")],
                                             scenario)
    assert [model.id for model in models.data] == ["asyncrl"]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "the sum is"
    assert chunks[-1].choices[0].finish_reason == "stop"
    calls = [tc for chunk in tool_chunks for tc in (chunk.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("add", {"a": 2, "b": 3})]
    assert tool_chunks[-1].choices[0].finish_reason == "tool_calls"


def streamed(chunks) -> dict:
    """The assistant message an agent puts together from a stream's deltas, as the OpenAI docs show."""
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
                entry["id"] += tc.id or ""
                entry["function"]["name"] += tc.function.name or ""
                entry["function"]["arguments"] += tc.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message


def test_a_streaming_engine_is_streamed_token_by_token_and_tool_calls_come_as_deltas(tokenizer):
    """From an engine that grows its completion, content arrives in many chunks that add up to the reply; a
    tool call is never streamed as text but as a tool_calls delta; usage comes only when stream_options asks;
    what the agent put together from the deltas is accepted back, and the episode holds the engine's tokens."""
    async def scenario(endpoint, engine):
        session = endpoint.sessions["s5"] = AgentSession("s5", tokenizer, BUDGET, max_tokens=128)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s5", max_retries=0)
        try:
            messages = list(ROW.messages)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="asyncrl", messages=messages, tools=[ADD], stream=True,
                                                     stream_options={"include_usage": "yes"})
            assert refused.value.code == "bad_parameter" and "include_usage" in refused.value.message
            stream = await client.chat.completions.create(model="asyncrl", messages=messages, tools=[ADD],
                                                          stream=True, stream_options={"include_usage": True})
            first = [chunk async for chunk in stream]
            messages += [streamed(first), {"role": "user", "content": "use the tool"}]
            stream = await client.chat.completions.create(model="asyncrl", messages=messages, tools=[ADD],
                                                          stream=True)
            second = [chunk async for chunk in stream]
            messages.append(streamed(second))
            messages.append({"role": "tool", "tool_call_id": messages[-1]["tool_calls"][0]["id"], "content": "5"})
            third = await client.chat.completions.create(model="asyncrl", messages=messages, tools=[ADD])
        finally:
            await client.close()
        return session, first, second, third, messages

    turns = [("the sum is 5", "stop"), (f"adding {call('add', a=2, b=3)}", "stop"), ("5", "stop")]
    (session, first, second, third, messages), engine = serve(tokenizer, turns, scenario, StreamingScriptedEngine)
    texts = [choice.delta.content for chunk in first for choice in chunk.choices if choice.delta.content]
    assert len(texts) > 1 and "".join(texts) == "the sum is 5" == messages[1]["content"]
    assert first[-1].choices == [] and first[-1].usage.completion_tokens == len(engine.sampled[0])
    assert first[-2].choices[0].finish_reason == "stop"
    assert all(chunk.usage is None for chunk in second)
    assert messages[3]["content"] == "adding" and all("<" not in (choice.delta.content or "")
                                                      for chunk in second for choice in chunk.choices)
    assert [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in messages[3]["tool_calls"]] \
        == [("add", {"a": 2, "b": 3})]
    assert second[-1].choices[0].finish_reason == "tool_calls"
    assert third.choices[0].message.content == "5"  # the history the agent built from the deltas was accepted
    episode = session.episode
    assert episode.sequence == engine.requests[2] + engine.sampled[2]
    model_tokens = [token for token, mask in zip(episode.sequence[episode.prompt_len:], episode.loss_mask) if mask]
    assert model_tokens == engine.sampled[0] + engine.sampled[1] + engine.sampled[2]


class FailingStreamEngine(StreamingScriptedEngine):
    """Streams two tokens of its second turn, then fails as a broken engine would."""

    async def sample_stream(self, prompt_ids, sampling):
        index = 0
        async for completion in super().sample_stream(prompt_ids, sampling):
            if index == 2 and len(self.requests) == 2:
                raise RuntimeError("the engine broke")
            index += 1
            yield completion


def test_an_engine_failing_mid_stream_ends_it_with_an_error_and_the_request_can_be_sent_again(tokenizer):
    """The failed turn is not recorded and the messages its request appended are forgotten: the same request
    sent again is answered (not 409, not "nothing new"), and the episode holds the environment turn once."""
    async def scenario(endpoint, engine):
        session = endpoint.sessions["s6"] = AgentSession("s6", tokenizer, BUDGET, max_tokens=128)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s6", max_retries=0)
        try:
            first = await client.chat.completions.create(model="asyncrl", messages=ROW.messages, stream=True)
            messages = [*ROW.messages, streamed([chunk async for chunk in first]),
                        {"role": "user", "content": "again"}]
            stream = await client.chat.completions.create(model="asyncrl", messages=messages, stream=True)
            with pytest.raises(openai.APIError, match="the engine broke"):
                [chunk async for chunk in stream]
            again = await client.chat.completions.create(model="asyncrl", messages=messages)
            return session, again
        finally:
            await client.close()

    (session, again), engine = serve(tokenizer, [("the sum is", "stop"), ("5", "stop"), ("6", "stop")], scenario,
                                     FailingStreamEngine)
    assert again.choices[0].message.content == "6"
    assert engine.requests[2] == engine.requests[1]  # the retry's prompt is the failed request's
    assert session.episode.sequence == engine.requests[2] + engine.sampled[2]
    model = [token for token, mask in zip(session.episode.sequence[session.episode.prompt_len:],
                                          session.episode.loss_mask) if mask]
    assert model == engine.sampled[0] + engine.sampled[2]


def test_requests_the_episode_cannot_take_are_refused_with_the_reason_and_counted_by_cause(tokenizer):
    """Each refusal's error object names its cause (`code`) and the field at fault (`param`), the message says
    which message differs and what was expected, and the endpoint counts it in rollout/http_refusals/<cause>."""
    async def scenario(endpoint, engine):
        endpoint.sessions["s2"] = AgentSession("s2", tokenizer, BUDGET, max_tokens=128)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s2", max_retries=0)
        stranger = openai.AsyncOpenAI(base_url=endpoint.url, api_key="nobody", max_retries=0)
        errors = {}
        try:
            first = await client.chat.completions.create(model="asyncrl", messages=ROW.messages, tools=[ADD])
            reply = first.choices[0].message.model_dump(exclude_none=True)
            then = {"role": "user", "content": "and?"}
            edited = [*ROW.messages, {"role": "assistant", "content": "something else"}, then]
            create = client.chat.completions.create
            for name, request in (
                    ("edited", create(model="asyncrl", messages=edited, tools=[ADD])),
                    ("omitted", create(model="asyncrl", messages=[*ROW.messages, then], tools=[ADD])),
                    ("tools", create(model="asyncrl", messages=[*ROW.messages, reply, then])),
                    ("stranger", stranger.chat.completions.create(model="asyncrl", messages=ROW.messages)),
                    ("n", create(model="asyncrl", messages=ROW.messages, n=2)),
                    ("zero", create(model="asyncrl", messages=[*ROW.messages, reply, then], tools=[ADD],
                                    max_tokens=0)),
                    ("negative", create(model="asyncrl", messages=[*ROW.messages, reply, then], tools=[ADD],
                                        max_completion_tokens=-5)),
                    ("nothing_new", create(model="asyncrl", messages=[*ROW.messages, reply], tools=[ADD]))):
                try:
                    await request
                except openai.APIStatusError as err:
                    errors[name] = (err.status_code, err.code, err.param, err.message)
            # refused requests left the episode as it was: the right continuation still works
            second = await create(model="asyncrl", messages=[*ROW.messages, reply, then], tools=[ADD])
        finally:
            await client.close()
            await stranger.close()
        return errors, second, endpoint.metrics()

    (errors, second, metrics), _ = serve(tokenizer, [("4", "stop"), ("5", "stop")], scenario)
    assert errors["edited"][:3] == (400, "history_edited", "messages")
    assert ("messages[1] (assistant) differs from the reply this episode's turn 1 returned: expected {role "
            "'assistant', content '4'}, got {role 'assistant', content 'something else'}") in errors["edited"][3]
    assert errors["omitted"][:3] == (400, "reply_omitted", "messages")
    assert "omits the assistant reply of turn 1 (expected messages[1] to be it" in errors["omitted"][3]
    assert errors["tools"][:3] == (400, "tools_changed", "tools")
    assert errors["stranger"][:2] == (401, "unknown_key") and "unknown session" in errors["stranger"][3]
    assert errors["n"][:3] == (400, "bad_parameter", "n") and "n must be 1" in errors["n"][3]
    assert errors["zero"][:3] == (400, "bad_parameter", "max_tokens")
    assert "max_tokens must be a positive integer, got 0" in errors["zero"][3]
    assert errors["negative"][:3] == (400, "bad_parameter", "max_completion_tokens")
    assert errors["nothing_new"][:3] == (400, "nothing_new", "messages")
    assert second.choices[0].message.content == "5"
    assert metrics == {"rollout/http_refusals/bad_parameter": 3.0, "rollout/http_refusals/history_edited": 1.0,
                       "rollout/http_refusals/nothing_new": 1.0, "rollout/http_refusals/reply_omitted": 1.0,
                       "rollout/http_refusals/tools_changed": 1.0, "rollout/http_refusals/unknown_key": 1.0}


def test_a_reply_whose_tool_calls_are_all_wrong_says_so_and_is_counted(tokenizer):
    """In agent mode a tool call the model got wrong is counted in rollout/tool_errors/<reason>; when no call in
    the reply is right, finish_reason is "malformed_tool_call" (plain and streamed), which the official client
    passes through, and the agent gets the text to send back."""
    async def scenario(endpoint, engine):
        endpoint.sessions["s4"] = AgentSession("s4", tokenizer, BUDGET, max_tokens=128)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s4", max_retries=0)
        try:
            plain = await client.chat.completions.create(model="asyncrl", messages=ROW.messages, tools=[ADD])
            messages = [*ROW.messages, plain.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": "that call was broken, try again"}]
            stream = await client.chat.completions.create(model="asyncrl", messages=messages, tools=[ADD],
                                                          stream=True)
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
        return plain, chunks, endpoint.metrics()

    broken = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    mixed = f'{call("add", a=2, b=3)}<tool_call>{{"name": "mul"}}</tool_call>'
    (plain, chunks, metrics), _ = serve(tokenizer, [(broken, "stop"), (mixed, "stop")], scenario)
    assert plain.choices[0].finish_reason == "malformed_tool_call"
    assert plain.choices[0].message.content == broken and not plain.choices[0].message.tool_calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"  # one right call: the agent runs it
    assert metrics == {"rollout/tool_errors/malformed": 1.0, "rollout/tool_errors/unknown_tool": 1.0}


def test_a_client_that_asks_for_standard_finish_reasons_gets_stop_for_a_malformed_call(tokenizer):
    """`X-Asyncrl-Finish-Reason: standard` (for clients that validate finish_reason against OpenAI's values, as
    verifiers does) turns malformed_tool_call into "stop", plain and streamed; the error is still counted. Any
    other value of the header is refused as a bad parameter."""
    header = {"X-Asyncrl-Finish-Reason": "standard"}

    async def scenario(endpoint, engine):
        endpoint.sessions["s5"] = AgentSession("s5", tokenizer, BUDGET, max_tokens=128)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s5", max_retries=0, default_headers=header)
        try:
            try:
                await client.chat.completions.create(model="asyncrl", messages=ROW.messages, tools=[ADD],
                                                     extra_headers={"X-Asyncrl-Finish-Reason": "mine"})
            except openai.BadRequestError as err:
                refused = (err.code, err.param)
            plain = await client.chat.completions.create(model="asyncrl", messages=ROW.messages, tools=[ADD])
            messages = [*ROW.messages, plain.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": "that call was broken, try again"}]
            stream = await client.chat.completions.create(model="asyncrl", messages=messages, tools=[ADD],
                                                          stream=True)
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
        return refused, plain, chunks, endpoint.metrics()

    broken = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    (refused, plain, chunks, metrics), _ = serve(tokenizer, [(broken, "stop"), (broken, "stop")], scenario)
    assert refused == ("bad_parameter", "x-asyncrl-finish-reason")
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content == broken
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert metrics["rollout/tool_errors/malformed"] == 2.0


def test_agent_failures_end_their_episode_and_are_counted(tokenizer):
    async def broken(row, client):
        await client.chat.completions.create(model="asyncrl", messages=row["prompt"])
        raise RuntimeError("my harness crashed")

    async def silent(row, client):
        return 1.0

    async def sleepy(row, client):
        await asyncio.sleep(30)

    async def stubborn(row, client):
        """Does not handle the endpoint's refusal of its edited history."""
        await client.chat.completions.create(model="asyncrl", messages=row["prompt"])
        await client.chat.completions.create(model="asyncrl", messages=[
            *row["prompt"], {"role": "assistant", "content": "five"}, {"role": "user", "content": "sure?"}])

    async def worded(row, client):
        await client.chat.completions.create(model="asyncrl", messages=row["prompt"])
        return "five"

    async def scenario(endpoint, engine):
        results = {}
        for fn in (broken, silent, sleepy, stubborn, worded):
            runner = OpenAIAgentRunner(endpoint, fn, tokenizer, BUDGET, max_tokens=128, timeout_s=1.0)
            episode = await runner.run(ROW, SAMPLING)
            results[fn.__name__] = (episode.finish_reason, episode.env_error, runner.metrics(), episode.turns)
        return results, dict(endpoint.sessions)

    (results, left), _ = serve(tokenizer, [("4", "stop")] * 4, scenario)
    assert results["broken"][:3] == ("env_error", "agent_error", {"rollout/env_errors/agent_error": 1.0})
    assert results["broken"][3] == 1
    assert results["silent"][:3] == ("env_error", "no_requests", {"rollout/env_errors/no_requests": 1.0})
    assert results["sleepy"][:2] == ("env_error", "agent_timeout")
    assert results["stubborn"][:3] == ("env_error", "agent_refused", {
        "rollout/env_errors/agent_refused": 1.0, "rollout/http_refusals/history_edited": 1.0})
    assert results["worded"][:2] == ("env_error", "bad_reward")
    assert left == {}  # every session is closed with its episode


class SlowEngine(ScriptedEngine):
    async def sample(self, prompt_ids, sampling, n):
        await asyncio.sleep(0.3)
        return await super().sample(prompt_ids, sampling, n)


def test_a_second_concurrent_request_in_one_episode_is_refused(tokenizer):
    engine = SlowEngine(tokenizer, [("4", "stop")] * 2)
    endpoint = OpenAIEndpoint(engine, "asyncrl", SAMPLING)

    async def scenario():
        await endpoint.start()
        endpoint.sessions["s3"] = AgentSession("s3", tokenizer, BUDGET, max_tokens=128)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="s3", max_retries=0)
        try:
            return await asyncio.gather(*(client.chat.completions.create(model="asyncrl", messages=ROW.messages)
                                          for _ in range(2)), return_exceptions=True)
        finally:
            await client.close()
            await endpoint.close()

    answers = asyncio.run(scenario())
    refused = [answer for answer in answers if isinstance(answer, openai.APIStatusError)]
    assert len(refused) == 1 and refused[0].status_code == 409 and len(engine.requests) == 1
    assert refused[0].code == "concurrent_request"
    assert endpoint.metrics() == {"rollout/http_refusals/concurrent_request": 1.0}
