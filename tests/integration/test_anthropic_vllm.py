"""The Anthropic Messages endpoint on the real vLLM CPU engine (the session's shared fixture,
tests/integration/conftest.py): `client.messages.stream(...)` yields the reply token by token, in several text
deltas, its final message is the one a plain request answers, and the episode holds exactly what vLLM samples."""
import pytest

pytestmark = pytest.mark.vllm


def test_the_messages_endpoint_streams_vllms_tokens_as_they_are_sampled(vllm_engine, demo_assets,
                                                                        event_loop_runner):
    import anthropic

    from asyncrl.buffer.group import Sampling
    from asyncrl.generator.agents.episode import EpisodeBudget
    from asyncrl.generator.agents.openai_server import OpenAIEndpoint
    from asyncrl.generator.agents.openai_session import AgentSession
    from asyncrl.learner.model import load_tokenizer

    tokenizer = load_tokenizer(demo_assets[0])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>" \
                              "{% endif %}{% endfor %}"
    greedy = Sampling(temperature=0.0, max_tokens=12)
    messages = [{"role": "user", "content": "sort:5021="}]

    async def scenario():
        endpoint = OpenAIEndpoint(vllm_engine, "asyncrl", greedy)
        await endpoint.start()
        for key in ("plain", "streamed"):
            endpoint.sessions[key] = AgentSession(key, tokenizer, EpisodeBudget(4, 0, 64, 16), max_tokens=12)
        root = endpoint.url.removesuffix("/v1")
        try:
            async with anthropic.AsyncAnthropic(base_url=root, api_key="plain", max_retries=0) as client:
                plain = await client.messages.create(model="asyncrl", max_tokens=12, messages=messages)
            async with anthropic.AsyncAnthropic(base_url=root, api_key="streamed", max_retries=0) as client:
                async with client.messages.stream(model="asyncrl", max_tokens=12, messages=messages) as stream:
                    texts = [text async for text in stream.text_stream]
                    final = await stream.get_final_message()
            episode = endpoint.sessions["streamed"].episode
            (direct,) = await vllm_engine.sample(episode.sequence[:episode.prompt_len], greedy, 1)
            return plain, texts, final, episode, direct
        finally:
            await endpoint.close()

    plain, texts, final, episode, direct = event_loop_runner.run_until_complete(scenario())
    assert len(texts) > 1 and "".join(texts) == plain.content[0].text, (texts, plain)
    plain, final = plain.model_dump(), final.model_dump()
    assert final.pop("id") == "msg_streamed-1" and plain.pop("id") == "msg_plain-1" and final == plain
    assert final["usage"]["output_tokens"] == len(direct.token_ids)
    assert episode.sequence[episode.prompt_len:] == direct.token_ids  # never re-tokenized
    assert len(episode.logprobs) == len(direct.token_ids)
