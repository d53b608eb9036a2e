"""The real vLLM CPU engine, shared by the session (tests/integration/conftest.py): logprob parity with the learner
and weight updates. Every test that loads other weights puts the demo model's back."""
import asyncio
import re

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import load_model
from asyncrl.generator.engines.base import WeightLoadError
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.receiver import WeightStage
from tests.stream_spy import DeliverySpy

pytestmark = pytest.mark.vllm
PROMPTS = [[31 % 19, 5, 7, 9, 3], [4, 6, 8, 2, 10, 11]]


def learner_logprobs(model, prompt, completion, temperature, top_k=-1, top_p=1.0):
    ids = torch.tensor([prompt + completion])
    logprobs, _ = compute_logprobs(model, ids, torch.ones_like(ids), torch.tensor([temperature]), 64,
                                   top_ks=torch.tensor([top_k]), top_ps=torch.tensor([top_p]))
    return logprobs[0, len(prompt) - 1:].tolist()


@pytest.mark.parametrize("top_k, top_p", [(-1, 0.9), (5, 1.0), (8, 0.8)])
def test_logprobs_over_a_top_k_or_top_p_nucleus_match_vllms(vllm_engine, demo_assets, event_loop_runner, top_k,
                                                            top_p):
    """vLLM's processed logprobs are those of the truncated, renormalised distribution; the learner computes the
    same over the same nucleus (learner/nucleus.py), and the full softmax does not match."""
    model = load_model(demo_assets[0]).eval()
    prompt = PROMPTS[1]
    sampling = Sampling(temperature=0.7, top_k=top_k, top_p=top_p, max_tokens=8)
    completions = event_loop_runner.run_until_complete(vllm_engine.sample(prompt, sampling, n=4))
    worst, truncated = 0.0, False
    with torch.no_grad():
        for completion in completions:
            expected = np.array(learner_logprobs(model, prompt, completion.token_ids, 0.7, top_k, top_p))
            worst = max(worst, float(np.max(np.abs(expected - np.array(completion.logprobs)))))
            full = np.array(learner_logprobs(model, prompt, completion.token_ids, 0.7))
            truncated |= bool(np.max(np.abs(full - np.array(completion.logprobs))) > 1e-3)
    assert worst < 1e-4, worst
    assert truncated, "the nucleus never removed any mass: the test would not see a missing truncation"


def test_n_samples_with_processed_logprobs_match_the_learner_at_temperature(vllm_engine, demo_assets,
                                                                            event_loop_runner):
    model = load_model(demo_assets[0]).eval()
    prompt = PROMPTS[0]
    completions = event_loop_runner.run_until_complete(
        vllm_engine.sample(prompt, Sampling(temperature=0.7, max_tokens=8), n=4))
    assert len(completions) == 4
    worst = 0.0
    with torch.no_grad():
        for completion in completions:
            assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) > 0
            expected = learner_logprobs(model, prompt, completion.token_ids, 0.7)
            worst = max(worst, float(np.max(np.abs(np.array(expected) - np.array(completion.logprobs)))))
            raw = learner_logprobs(model, prompt, completion.token_ids, 1.0)
            assert not np.allclose(raw, completion.logprobs, atol=1e-3), "logprobs are raw, not processed"
    assert worst < 1e-4, worst


class CountdownEnv:
    """Answers every model turn with another sorting task until the model has had three turns."""

    async def reset(self, row):
        return None

    async def step(self, text):
        from asyncrl.generator.agents.environment import StepResult

        return StepResult(messages=[{"role": "user", "content": "sort:" + "3120"[: 2 + len(text) % 3] + "="}])


def test_a_three_turn_episode_matches_the_learners_logprobs_on_every_model_token(vllm_engine, demo_assets,
                                                                                 event_loop_runner):
    """Runs before the tests that load other weights: the engine still has the demo model's. The demo tokenizer
    gets a template that ends each turn with its eos (the stop token), so turns can be appended."""
    from asyncrl.generator.agents.chat_render import ChatAppender
    from asyncrl.generator.agents.episode import EpisodeBudget, EpisodeRunner
    from asyncrl.data.prompts import PromptRow
    from asyncrl.learner.model import load_tokenizer

    tokenizer = load_tokenizer(demo_assets[0])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>" \
                              "{% endif %}{% endfor %}"
    runner = EpisodeRunner(vllm_engine, tokenizer, ChatAppender(tokenizer), CountdownEnv,
                           EpisodeBudget(max_turns=3, max_episode_tokens=0, max_model_len=64, max_prompt_tokens=16),
                           step_timeout_s=5.0)
    row = PromptRow("p", [], "asyncrl/sort_digits", "0125", {}, messages=[{"role": "user", "content": "sort:5021="}])
    sampling = Sampling(temperature=0.7, max_tokens=8)
    async def four_episodes():
        return await asyncio.gather(*(runner.run(row, sampling) for _ in range(4)))

    episodes = event_loop_runner.run_until_complete(four_episodes())
    full = [episode for episode in episodes if episode.turns == 3]
    assert full, [episode.finish_reason for episode in episodes]
    model = load_model(demo_assets[0]).eval()
    with torch.no_grad():
        for episode in full:
            assert episode.finish_reason in ("max_turns", "length") and episode.env_tokens > 0
            prompt, after = episode.sequence[:episode.prompt_len], episode.sequence[episode.prompt_len:]
            expected = np.array(learner_logprobs(model, prompt, after, 0.7))
            mask = np.array(episode.loss_mask, dtype=bool)
            assert mask.sum() == len(after) - episode.env_tokens
            assert np.max(np.abs(expected[mask] - np.array(episode.logprobs)[mask])) < 1e-4
            assert np.all(np.array(episode.logprobs)[~mask] == 0.0)  # tool tokens carry no loss and no logprob


def test_an_openai_client_agent_on_the_endpoint_records_what_vllm_sampled(vllm_engine, demo_assets,
                                                                         event_loop_runner):
    """The official openai client against the generator's endpoint backed by the real engine: a 2-request agent;
    the recorded episode's model tokens carry vLLM's logprobs, which equal the learner's within 1e-4."""
    from asyncrl.generator.agents.episode import EpisodeBudget
    from asyncrl.generator.agents.openai_agent import OpenAIAgentRunner
    from asyncrl.generator.agents.openai_server import OpenAIEndpoint
    from asyncrl.data.prompts import PromptRow
    from asyncrl.learner.model import load_tokenizer

    tokenizer = load_tokenizer(demo_assets[0])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>" \
                              "{% endif %}{% endfor %}"
    sampling = Sampling(temperature=0.7, max_tokens=12)

    async def agent(row, client):
        messages = list(row["prompt"])
        reply = await client.chat.completions.create(model="asyncrl", messages=messages)
        if reply.choices[0].finish_reason == "length":
            return 0.0  # a turn cut by max_tokens cannot be continued (the endpoint would refuse)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "sort:31="}]
        await client.chat.completions.create(model="asyncrl", messages=messages)
        return 1.0

    async def scenario():
        endpoint = OpenAIEndpoint(vllm_engine, "asyncrl", sampling)
        await endpoint.start()
        try:
            runner = OpenAIAgentRunner(endpoint, agent, tokenizer, EpisodeBudget(4, 0, 64, 16), max_tokens=12,
                                       timeout_s=60)
            row = PromptRow("p", [], "asyncrl/sort_digits", "0125", {},
                            messages=[{"role": "user", "content": "sort:5021="}])
            return await asyncio.gather(*(runner.run(row, sampling) for _ in range(8)))
        finally:
            await endpoint.close()

    episodes = event_loop_runner.run_until_complete(scenario())
    assert all(episode.env_error == "" for episode in episodes), [episode.env_error for episode in episodes]
    episodes = [episode for episode in episodes if episode.turns == 2]
    assert episodes, "no first turn of 8 ended with the stop token"
    model = load_model(demo_assets[0]).eval()
    with torch.no_grad():
        for episode in episodes:
            assert episode.rewards == [1.0] and episode.env_tokens > 0 and episode.finish_reason in ("stop", "length")
            prompt, after = episode.sequence[:episode.prompt_len], episode.sequence[episode.prompt_len:]
            expected = np.array(learner_logprobs(model, prompt, after, 0.7))
            mask = np.array(episode.loss_mask, dtype=bool)
            assert np.max(np.abs(expected[mask] - np.array(episode.logprobs)[mask])) < 1e-4


def test_the_endpoint_streams_vllms_tokens_as_they_are_sampled(vllm_engine, demo_assets, event_loop_runner):
    """The official openai client with stream=True against the endpoint on vLLM: a multi-token greedy reply
    arrives in one content chunk per delivery from vLLM (tried until vLLM delivers it in several: a loaded
    machine gets it whole now and then), the chunks add up to the non-streamed reply, usage comes last only when asked,
    and the episode records exactly the tokens vLLM samples for that prompt. A client that leaves mid-stream
    aborts vLLM's request and leaves no trace in its episode."""
    import openai

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
        try:
            replies, growths = {}, []
            keys = [("plain", None), ("bare", None)] + [(f"usage{n}", {"include_usage": True}) for n in range(8)]
            for key, options in keys:  # the usage stream again until vLLM delivers the reply in several pieces
                endpoint.sessions[key] = AgentSession(key, tokenizer, EpisodeBudget(4, 0, 64, 16), max_tokens=12)
                async with openai.AsyncOpenAI(base_url=endpoint.url, api_key=key, max_retries=0) as client:
                    if key == "plain":
                        replies[key] = await client.chat.completions.create(model="asyncrl", messages=messages)
                        continue
                    stream = await client.chat.completions.create(
                        model="asyncrl", messages=messages, stream=True,
                        **({"stream_options": options} if options else {}))
                    replies[key] = [chunk async for chunk in stream]
                episode = endpoint.sessions[key].episode
                growths.append((key, spy.text_growths(episode.sequence[episode.prompt_len:], tokenizer)))
                if key.startswith("usage") and growths[-1][1] > 1:
                    break
            episode = endpoint.sessions["plain"].episode
            (direct,) = await vllm_engine.sample(episode.sequence[:episode.prompt_len], greedy, 1)
            endpoint.sessions["gone"] = AgentSession("gone", tokenizer, EpisodeBudget(4, 0, 64, 16), max_tokens=12)
            async with openai.AsyncOpenAI(base_url=endpoint.url, api_key="gone", max_retries=0) as client:
                stream = await client.chat.completions.create(model="asyncrl", messages=messages, stream=True)
                async for chunk in stream:  # a client that leaves after the first content
                    if chunk.choices and chunk.choices[0].delta.content:
                        break
                await stream.close()
                for _ in range(200):  # the endpoint aborts the engine's request once it sees the client gone
                    if not vllm_engine.in_flight and not endpoint.sessions["gone"].busy:
                        break
                    await asyncio.sleep(0.05)
                left = dict(vllm_engine.in_flight), endpoint.sessions["gone"].episode
                replies["gone"] = await client.chat.completions.create(model="asyncrl", messages=messages)
            return replies, growths, endpoint.sessions, direct, left
        finally:
            await endpoint.close()

    replies, growths, sessions, direct, left = event_loop_runner.run_until_complete(scenario())
    plain = replies["plain"].choices[0].message.content
    assert left == ({}, None)  # vLLM's request aborted, the unrecorded turn undone
    assert replies["gone"].choices[0].message.content == plain  # and the same request answered afterwards
    for key, count in growths[1:]:  # one content chunk per delivery that adds text, sent as it comes
        texts = [choice.delta.content for chunk in replies[key] for choice in chunk.choices if choice.delta.content]
        assert len(texts) == count and "".join(texts) == plain, (key, texts, count, plain)
    usage = growths[-1][0]
    assert growths[-1][1] > 1, f"vLLM delivered the reply whole every time: {growths}"
    assert replies[usage][-1].choices == [] and replies[usage][-1].usage.completion_tokens == len(direct.token_ids)
    assert replies[usage][-2].choices[0].finish_reason == replies["plain"].choices[0].finish_reason
    assert all(chunk.usage is None for chunk in replies["bare"])
    for key in (usage, "bare"):
        episode = sessions[key].episode
        assert episode.sequence[episode.prompt_len:] == direct.token_ids  # never re-tokenized
        assert len(episode.logprobs) == len(direct.token_ids)


def test_weight_update_changes_greedy_outputs_and_never_serves_stale_prefix_cache(vllm_engine, demo_assets,
                                                                                 event_loop_runner, tmp_path):
    run = event_loop_runner.run_until_complete
    # True greedy (T = 0: vLLM's argmax, no sampling). Near-greedy sampling (T = 1e-4) picked a token up to 0.05
    # logits below the argmax about one run in five, on the old reload path as on this one, while the logprobs at
    # T = 0.7 and T = 1 matched the learner's within 1e-4: vLLM's CPU sampler, not the weights.
    greedy = Sampling(temperature=0.0, max_tokens=6)
    prompt = PROMPTS[1]
    run(vllm_engine.sample(prompt, greedy, n=1))  # the prompt's KV is now in the prefix cache
    model = load_model(demo_assets[0]).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 3, 1 << 20), WeightStage(str(tmp_path), "t")
    try:
        staged = stage.stage(publish(publisher, model.state_dict(), 7))
        run(vllm_engine.load_weights(staged))
        stage.end_load(staged, ok=True)
        after = run(vllm_engine.sample(prompt, greedy, n=1))[0]
        assert set(after.versions) == {7}
        with torch.no_grad():
            ids = torch.tensor([prompt])
            expected = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(prompt):]
        assert after.token_ids == expected.tolist()[: len(after.token_ids)]
        # Stale KV of the cached prompt (computed by the old weights) would make these logprobs the old model's.
        sampled = run(vllm_engine.sample(prompt, Sampling(temperature=0.7, max_tokens=6), n=2))
        with torch.no_grad():
            for completion in sampled:
                expected_logprobs = learner_logprobs(model, prompt, completion.token_ids, 0.7)
                assert np.max(np.abs(np.array(expected_logprobs) - np.array(completion.logprobs))) < 1e-4
    finally:  # the original weights back for the other tests, whatever happened
        original = load_model(demo_assets[0])
        staged = stage.stage(publish(publisher, original.state_dict(), 8))
        run(vllm_engine.load_weights(staged, stage.good))
        stage.end_load(staged, ok=True)
        stage.close()
        publisher.close()


def publish(publisher, state: dict, version: int) -> dict:
    specs = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]
    return publisher.publish(iter(state.items()), version, specs)


def broken_version(demo_assets, seed: int) -> dict:
    """The demo model's tensors, perturbed, with one tensor late in the load order of the wrong shape."""
    state = dict(load_model(demo_assets[0]).state_dict())
    torch.manual_seed(seed)
    broken = {name: tensor + 0.5 * torch.randn_like(tensor) for name, tensor in state.items()}
    broken[list(broken)[-2]] = torch.zeros(3, 5)
    return broken


def test_a_version_that_does_not_fit_the_checkpoint_is_refused_before_the_engine_is_touched(
        vllm_engine, demo_assets, event_loop_runner, tmp_path):
    run = event_loop_runner.run_until_complete
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 3, 1 << 20), WeightStage(str(tmp_path), "t")
    staged = stage.stage(publish(publisher, broken_version(demo_assets, 3), 12))
    version = vllm_engine.version
    with pytest.raises(WeightLoadError, match=r"does not fit the model's checkpoint.*shape \(3, 5\)"):
        run(vllm_engine.load_weights(staged, stage.good))
    stage.end_load(staged, ok=False)
    state = dict(load_model(demo_assets[0]).state_dict())
    state.pop(list(state)[3])
    incomplete = stage.stage(publish(WeightPublisher(str(tmp_path / "r2"), 2, 1 << 20), state, 13))
    with pytest.raises(WeightLoadError, match="missing tensor"):  # vLLM would keep old values silently
        run(vllm_engine.load_weights(incomplete, stage.good))
    assert vllm_engine.version == version
    stage.close()
    publisher.close()


def test_a_load_failing_halfway_goes_back_to_the_last_good_version(vllm_engine, demo_assets, event_loop_runner,
                                                                   tmp_path):
    """Should a load still fail midway (the pre-check is switched off here, so vLLM meets the bad tensor in a later
    bucket, after the earlier buckets replaced many tensors), a CPU engine left like that dies on its next generate.
    The engine reloads its last good version through the same weight-transfer calls before it resumes, and samples
    exactly as before."""
    run = event_loop_runner.run_until_complete
    greedy = Sampling(temperature=0.0, max_tokens=6)  # vLLM's argmax (see the weight-update test)
    prompt = PROMPTS[1]
    before = run(vllm_engine.sample(prompt, greedy, n=1))[0]
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 3, 1 << 20), WeightStage(str(tmp_path), "t")
    staged = stage.stage(publish(publisher, broken_version(demo_assets, 2), 11))
    expected, vllm_engine._expected = vllm_engine._expected, {}
    try:
        with pytest.raises(WeightLoadError, match="v11") as failure:
            run(vllm_engine.load_weights(staged, stage.good))
    finally:
        vllm_engine._expected = expected
    assert "kept v" in str(failure.value), failure.value
    failed_bucket, buckets = map(int, re.search(r"bucket (\d+) of (\d+) of v11", str(failure.value)).groups())
    assert 0 < failed_bucket < buckets, failure.value  # earlier buckets were loaded when it failed
    stage.end_load(staged, ok=False)
    after = run(vllm_engine.sample(prompt, greedy, n=1))[0]  # alive, and on the old weights
    assert after.token_ids == before.token_ids and set(after.versions) == set(before.versions) != {11}
    stage.close()
    publisher.close()


def test_temperature_zero_is_the_learner_models_greedy_decode(vllm_engine, demo_assets, event_loop_runner):
    """The ReMax baseline: vLLM's greedy completion equals argmax decoding with the same weights."""
    run = event_loop_runner.run_until_complete
    prompt = PROMPTS[0]
    first, second = (run(vllm_engine.sample(prompt, Sampling(temperature=0.0, max_tokens=6), n=1))[0]
                     for _ in range(2))
    assert first.token_ids and first.token_ids == second.token_ids
    model = load_model(demo_assets[0]).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(len(first.token_ids)):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(prompt):] == first.token_ids


def test_keep_mode_continues_in_flight_requests_on_the_new_weights_and_tags_the_switch(
        vllm_engine, demo_assets, event_loop_runner, tmp_path):
    """PipelineRL-style in-flight update: a request running when v21 arrives is not restarted; its tokens before
    the switch carry the old version and are exactly the old model's, and every token after it carries v21 and was
    sampled from the new weights (its logprob is not the old model's)."""
    run = event_loop_runner.run_until_complete
    prompt = PROMPTS[0]
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 3, 1 << 20), WeightStage(str(tmp_path), "k")
    old_model = load_model(demo_assets[0]).eval()
    old_version = vllm_engine.version
    new_model = load_model(demo_assets[0]).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for param in new_model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    staged = stage.stage(publish(publisher, new_model.state_dict(), 21))
    vllm_engine.update_mode = "keep"

    async def update_mid_request():
        # eight requests, so that some are still running when the update lands (a request may stop at EOS)
        task = asyncio.ensure_future(vllm_engine.sample(prompt, Sampling(temperature=1.0, max_tokens=50), n=8))
        while not any(len(c.token_ids) >= 5 for c in vllm_engine.in_flight.values()):
            assert not task.done(), "every request finished before the update could land mid-way"
            await asyncio.sleep(0.001)
        await vllm_engine.load_weights(staged, stage.good)
        return await task

    try:
        completions = run(update_mid_request())
    finally:
        vllm_engine.update_mode = "wait"
    stage.end_load(staged, ok=True)
    crossed = [c for c in completions if c.versions and c.versions[0] == old_version and c.versions[-1] == 21]
    assert crossed, [c.versions for c in completions]
    for completion in crossed:
        switch = completion.versions.index(21)
        assert set(completion.versions[:switch]) == {old_version} and set(completion.versions[switch:]) == {21}
        with torch.no_grad():
            old = np.array(learner_logprobs(old_model, prompt, completion.token_ids, 1.0))
        sampled = np.array(completion.logprobs)
        assert np.max(np.abs(old[:switch] - sampled[:switch])) < 1e-4  # before the switch: the old weights
        assert np.min(np.abs(old[switch:] - sampled[switch:])) > 1e-5  # after it: never the old weights
    original = stage.stage(publish(publisher, load_model(demo_assets[0]).state_dict(), 22))
    run(vllm_engine.load_weights(original, stage.good))  # put the original weights back for other tests
    stage.end_load(original, ok=True)
    stage.close()
    publisher.close()


def test_abort_mode_resubmits_in_flight_requests_on_the_new_weights_and_wait_mode_finishes_them_first(vllm_engine, demo_assets,
                                                                              event_loop_runner, tmp_path):
    run = event_loop_runner.run_until_complete
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 3, 1 << 20), WeightStage(str(tmp_path), "a")
    state = load_model(demo_assets[0]).state_dict()

    async def update_mid_request(mode: str, version: int):
        vllm_engine.update_mode = mode
        staged = stage.stage(publish(publisher, state, version))
        task = asyncio.ensure_future(vllm_engine.sample(PROMPTS[0], Sampling(temperature=1.0, max_tokens=50), n=8))
        while not any(len(c.token_ids) >= 3 for c in vllm_engine.in_flight.values()):
            assert not task.done(), "every request finished before the update could land mid-way"
            await asyncio.sleep(0.001)
        await vllm_engine.load_weights(staged, stage.good)
        stage.end_load(staged, ok=True)
        return await task

    resumed_before = vllm_engine.resumed_requests
    try:
        aborted = run(update_mid_request("abort", 31))
        finished = run(update_mid_request("wait", 32))
    finally:
        vllm_engine.update_mode = "wait"
    # abort: the requests in flight were ended by the update and resubmitted with what they had sampled as their
    # prefix; their first tokens keep the old version, the rest is v31's
    assert vllm_engine.resumed_requests > resumed_before
    assert all(c.finish_reason in ("stop", "length") for c in aborted)
    assert any(c.versions[0] != 31 and c.versions[-1] == 31 for c in aborted)
    assert all(c.versions == sorted(c.versions) for c in aborted)
    # wait: every request in flight ran to its end on the old weights before the load
    assert all(c.finish_reason in ("stop", "length") and 32 not in c.versions for c in finished)
    stage.close()
    publisher.close()
