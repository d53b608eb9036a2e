"""The Anthropic Messages endpoint on the real vLLM CPU engine (the session's shared fixture,
tests/integration/conftest.py): `client.messages.stream(...)` yields the reply as vLLM delivers it, one text delta
per delivery, its final message is the one a plain request answers, and the episode holds exactly what vLLM
samples."""
import pytest

from tests.stream_spy import DeliverySpy

pytestmark = pytest.mark.vllm

ATTEMPTS = 8  # a loaded machine may get a five-token reply from vLLM in one delivery; eight in a row would be news


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

    spy = DeliverySpy(vllm_engine)

    async def scenario():
        endpoint = OpenAIEndpoint(spy, "asyncrl", greedy)
        await endpoint.start()
        root = endpoint.url.removesuffix("/v1")
        endpoint.sessions["plain"] = AgentSession("plain", tokenizer, EpisodeBudget(4, 0, 64, 16), max_tokens=12)
        try:
            async with anthropic.AsyncAnthropic(base_url=root, api_key="plain", max_retries=0) as client:
                plain = await client.messages.create(model="asyncrl", max_tokens=12, messages=messages)
            tries = []
            for attempt in range(ATTEMPTS):  # until vLLM delivers the reply in more than one piece
                key = f"streamed{attempt}"
                endpoint.sessions[key] = AgentSession(key, tokenizer, EpisodeBudget(4, 0, 64, 16), max_tokens=12)
                async with anthropic.AsyncAnthropic(base_url=root, api_key=key, max_retries=0) as client:
                    async with client.messages.stream(model="asyncrl", max_tokens=12, messages=messages) as stream:
                        texts = [text async for text in stream.text_stream]
                        final = await stream.get_final_message()
                episode = endpoint.sessions[key].episode
                growths = spy.text_growths(episode.sequence[episode.prompt_len:], tokenizer)
                tries.append((texts, growths))
                if growths > 1:
                    break
            (direct,) = await vllm_engine.sample(episode.sequence[:episode.prompt_len], greedy, 1)
            return plain, tries, final, episode, direct
        finally:
            await endpoint.close()

    plain, tries, final, episode, direct = event_loop_runner.run_until_complete(scenario())
    # one text delta per delivery that adds text, sent as it comes: never held back and sent whole
    assert all(len(texts) == growths and "".join(texts) == plain.content[0].text for texts, growths in tries), \
        (tries, plain)
    assert tries[-1][1] > 1, f"vLLM delivered the reply whole {ATTEMPTS} times running: {tries}"
    plain, final = plain.model_dump(), final.model_dump()
    assert final.pop("id") == f"msg_streamed{len(tries) - 1}-1" and plain.pop("id") == "msg_plain-1"
    assert final == plain
    assert final["usage"]["output_tokens"] == len(direct.token_ids)
    assert episode.sequence[episode.prompt_len:] == direct.token_ids  # never re-tokenized
    assert len(episode.logprobs) == len(direct.token_ids)
