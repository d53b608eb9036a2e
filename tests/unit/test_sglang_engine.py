"""The sglang engine and its weight receiver against the faithful fake (tests/fakes/fake_sglang.py)."""
import asyncio
import functools
import os

import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.generator.engines.base import WeightLoadError, make_engine
from asyncrl.generator.engines.sglang_engine import SglangEngine, kv_cache_tokens, new_tokens
from tests.fakes.fake_sglang import EOS, FakeCollective, FakeSglangEngine, initial_weights, write_checkpoint

ADDRESS, PORT, GROUP_NAME = "127.0.0.1", 29555, "asyncrl-weights"


def group_spec(generation: int = 1, port: int = PORT) -> dict:
    return {"master_address": ADDRESS, "master_port": port, "world_size": 2, "rank_offset": 1,
            "group_name": GROUP_NAME, "backend": "nccl", "generation": generation}


def weights_without_eos(seed: int) -> dict:
    """Weights whose EOS logit is always -100, so requests run to max_tokens (deterministic lengths)."""
    weights = initial_weights(seed)
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["lm_head.weight"][EOS] = torch.tensor([-100.0] + [0.0] * 7)
    return weights


def message(version: int, weights: dict, group: dict, path: str | None = None) -> dict:
    return {"version": version, "names": list(weights),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
            "shapes": [list(t.shape) for t in weights.values()], "group": group, **({"path": path} if path else {})}


def build(tmp_path, update_mode: str = "wait", timeout_s: float = 2.0, drain_timeout_s: float = 2.0,
          **server_args) -> tuple:
    """(engine, collective, model_dir): a started SglangEngine on the fake, v0 = the checkpoint in model_dir."""
    from transformers import Qwen2Config

    model_dir = str(tmp_path / "model")
    Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(model_dir)
    write_checkpoint(model_dir, weights_without_eos(0))
    collective = FakeCollective()
    engine = SglangEngine(model_dir, "float32", max_model_len=64, kv_cache_gib=0.001, seed=0,
                          update_mode=update_mode, engine_factory=functools.partial(FakeSglangEngine, collective),
                          timeout_s=timeout_s, drain_timeout_s=drain_timeout_s, server_args=server_args)
    return engine, collective, model_dir


def calls(fake) -> list:
    return [name for name, _ in fake.calls]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_sampling_returns_token_ids_processed_logprobs_and_versions(tmp_path):
    engine, _, _ = build(tmp_path)

    async def main():
        await engine.start()
        return await engine.sample([3, 5, 7], Sampling(temperature=0.7, max_tokens=6), n=3), engine._engine

    completions, fake = run(main())
    assert len(completions) == 3
    for completion in completions:
        assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) == 6
        assert completion.versions == [0] * 6 and completion.finish_reason == "length"
        previous = 7
        for token, logprob in zip(completion.token_ids, completion.logprobs):  # log_softmax(logits / T)
            logits = fake.weights["lm_head.weight"] @ fake.weights["model.embed_tokens.weight"][previous]
            assert logprob == pytest.approx(float(torch.log_softmax(logits / 0.7, -1)[token]), abs=1e-6)
            previous = token


def test_greedy_tokens_carry_logprob_zero(tmp_path):
    engine, _, _ = build(tmp_path)

    async def main():
        await engine.start()
        return await engine.sample([3, 5], Sampling(temperature=0.0, max_tokens=4), n=1)

    (completion,) = run(main())
    assert completion.logprobs == [0.0] * 4 and len(completion.token_ids) == 4


def test_top_k_or_top_p_sampling_is_refused_because_sglang_logprobs_ignore_them(tmp_path):
    engine, _, _ = build(tmp_path)

    async def main():
        await engine.start()
        for sampling in (Sampling(temperature=1.0, top_k=5), Sampling(temperature=1.0, top_p=0.9)):
            with pytest.raises(ValueError, match="top-k/top-p"):
                await engine.sample([3], sampling, n=1)

    run(main())


def test_incremental_and_cumulative_stream_chunks_give_the_same_completion(tmp_path):
    results = []
    for incremental in (False, True):
        engine, _, _ = build(tmp_path / str(incremental), incremental_streaming_output=incremental)

        async def main():
            await engine.start()
            return await engine.sample([3, 5], Sampling(temperature=1.0, max_tokens=8), n=1)

        results.append(run(main())[0])
    assert results[0] == results[1]
    assert new_tokens({"completion_tokens": 3, "output_token_logprobs": [(-1.0, 4, None)]}, 2) == [(-1.0, 4)]
    assert new_tokens({"completion_tokens": 3, "output_token_logprobs": [(-1, 1), (-2, 2), (-3, 3)]}, 1) == [
        (-2, 2), (-3, 3)]


def test_update_pauses_receives_flushes_continues_in_order_and_bumps_versions(tmp_path):
    engine, collective, _ = build(tmp_path)
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        group = collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)
        group.broadcast(list(new.items()))
        await engine.receive_weights(message(1, new, group_spec()))
        return await engine.sample([3, 5], Sampling(temperature=1.0, max_tokens=5), n=2), engine._engine, group

    completions, fake, group = run(main())
    assert calls(fake) == ["init_weights_update_group", "pause_generation", "update_weights_from_distributed",
                           "flush_cache", "continue_generation"]
    update = fake.calls[2][1]
    assert update == {"names": list(new), "dtypes": ["float32", "float32"], "shapes": [[16, 8], [16, 8]],
                      "group_name": GROUP_NAME, "flush_cache": True, "weight_version": "1", "paused": True}
    assert fake.calls[1][1] == {"mode": "abort"} and group.members == [1]
    assert engine.version == 1 and fake.weight_version() == "1"
    assert all(torch.equal(fake.weights[name], tensor) for name, tensor in new.items())
    assert all(completion.versions == [1] * 5 for completion in completions)


def test_failed_update_stays_paused_rolls_back_to_last_good_and_never_serves_partial_weights(tmp_path):
    engine, collective, model_dir = build(tmp_path)
    good, new = weights_without_eos(0), weights_without_eos(1)

    async def sample_forever(stop: asyncio.Event) -> list:
        done = []
        while not stop.is_set():
            done += await engine.sample([3], Sampling(temperature=1.0, max_tokens=3), n=2)
        return done

    async def main():
        await engine.start()
        fake = engine._engine
        fake.step_delay_s = 0.002
        fake.fail_update_after = 1  # the head is written, the embedding is not: half-written weights
        group = collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)
        group.broadcast(list(new.items()))
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_forever(stop))
        await asyncio.sleep(0.02)
        with pytest.raises(WeightLoadError, match="v1.*partially updated.*reloaded v0"):
            await engine.receive_weights(message(1, new, group_spec()))
        after = await engine.sample([3], Sampling(temperature=1.0, max_tokens=4), n=1)
        stop.set()
        return fake, await sampler, after

    fake, during, (after,) = run(main())
    order = calls(fake)
    failed, reload = order.index("update_weights_from_distributed"), order.index("update_weights_from_disk")
    assert "continue_generation" not in order[failed:reload]  # paused from the failure until the reload
    assert order[-1] == "continue_generation" and fake.calls[reload][1]["model_path"] == model_dir
    assert fake.partial is None and engine.version == 0 and fake.weight_version() == "0"
    assert all(torch.equal(fake.weights[name], tensor) for name, tensor in good.items())
    assert during and all(set(c.versions) <= {0} for c in during)  # the fake raises on any partial-weight forward
    assert after.versions == [0] * 4


def test_rollback_target_is_the_newest_version_published_with_a_path(tmp_path):
    engine, collective, _ = build(tmp_path)
    v1, v2 = weights_without_eos(1), weights_without_eos(2)
    v1_dir = write_checkpoint(str(tmp_path / "v1"), v1)

    async def main():
        await engine.start()
        group = collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)
        group.broadcast(list(v1.items()))
        await engine.receive_weights(message(1, v1, group_spec(), path=v1_dir))
        engine._engine.fail_update_after = 0
        group.broadcast(list(v2.items()))
        with pytest.raises(WeightLoadError, match="reloaded v1"):
            await engine.receive_weights(message(2, v2, group_spec()))
        return engine._engine

    fake = run(main())
    assert engine.version == 1 and all(torch.equal(fake.weights[n], t) for n, t in v1.items())


def test_failed_rollback_leaves_the_engine_paused_and_every_sample_raises(tmp_path):
    engine, collective, _ = build(tmp_path)
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        engine._engine.fail_update_after, engine._engine.fail_disk_load = 0, True
        group = collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)
        group.broadcast(list(new.items()))
        with pytest.raises(WeightLoadError, match="rollback to v0 .* failed too"):
            await engine.receive_weights(message(1, new, group_spec()))
        with pytest.raises(WeightLoadError, match="restart it"):
            await engine.sample([3], Sampling(temperature=1.0, max_tokens=2), n=1)
        return engine._engine

    fake = run(main())
    assert fake.paused and fake.partial is not None


def test_group_is_joined_once_per_generation_and_rejoined_when_it_changes(tmp_path):
    engine, collective, _ = build(tmp_path)

    async def main():
        await engine.start()
        first = collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)
        for version in (1, 2):
            weights = weights_without_eos(version)
            first.broadcast(list(weights.items()))
            await engine.receive_weights(message(version, weights, group_spec(generation=1)))
        second = collective.open_group(ADDRESS, PORT + 1, GROUP_NAME, world_size=2)
        weights = weights_without_eos(3)
        second.broadcast(list(weights.items()))
        await engine.receive_weights(message(3, weights, group_spec(generation=2, port=PORT + 1)))
        return engine._engine

    fake = run(main())
    joins = [args for name, args in fake.calls if name == "init_weights_update_group"]
    assert [join["master_port"] for join in joins] == [PORT, PORT + 1]
    order = calls(fake)
    assert order.index("destroy_weights_update_group") < len(order) - order[::-1].index("init_weights_update_group")
    assert engine.version == 3


def test_join_timeout_names_the_peer_and_never_pauses_generation(tmp_path):
    engine, _, _ = build(tmp_path, timeout_s=0.2)
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        with pytest.raises(WeightLoadError, match=f"{ADDRESS}:{PORT} group '{GROUP_NAME}'.*0.2s"):
            await engine.receive_weights(message(1, new, group_spec()))  # the learner never opens the group
        return await engine.sample([3], Sampling(temperature=1.0, max_tokens=2), n=1), engine._engine

    (completion,), fake = run(main())
    assert "pause_generation" not in calls(fake) and completion.versions == [0, 0]


def test_update_timeout_names_the_peer_rolls_back_and_waits_for_a_new_group(tmp_path):
    engine, collective, _ = build(tmp_path, timeout_s=0.2)
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)  # joins, then never broadcasts
        with pytest.raises(WeightLoadError, match=f"receive v1: no answer from {ADDRESS}:{PORT} group"):
            await engine.receive_weights(message(1, new, group_spec()))
        with pytest.raises(WeightLoadError, match="new group generation"):
            await engine.receive_weights(message(2, new, group_spec()))
        rebuilt = collective.open_group(ADDRESS, PORT + 1, GROUP_NAME, world_size=2)
        rebuilt.broadcast(list(new.items()))
        await engine.receive_weights(message(2, new, group_spec(generation=2, port=PORT + 1)))
        return engine._engine

    fake = run(main())
    assert "update_weights_from_disk" in calls(fake) and engine.version == 2


def test_wait_mode_lets_in_flight_requests_finish_before_pausing(tmp_path):
    engine, collective, _ = build(tmp_path, update_mode="wait")
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        fake = engine._engine
        fake.step_delay_s = 0.005
        request = asyncio.create_task(engine.sample([3], Sampling(temperature=1.0, max_tokens=20), n=1))
        await asyncio.sleep(0.02)
        group = collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)
        group.broadcast(list(new.items()))
        await engine.receive_weights(message(1, new, group_spec()))
        return await request

    (completion,) = run(main())
    assert completion.finish_reason == "length" and completion.versions == [0] * 20


def test_abort_mode_returns_in_flight_requests_as_aborted(tmp_path):
    engine, collective, _ = build(tmp_path, update_mode="abort")
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        engine._engine.step_delay_s = 0.005
        request = asyncio.create_task(engine.sample([3], Sampling(temperature=1.0, max_tokens=40), n=1))
        await asyncio.sleep(0.03)
        group = collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)
        group.broadcast(list(new.items()))
        await engine.receive_weights(message(1, new, group_spec()))
        return await request

    (completion,) = run(main())
    assert completion.finish_reason == "abort" and 0 < len(completion.token_ids) < 40
    assert completion.versions == [0] * len(completion.token_ids)


def test_keep_mode_finishes_kept_requests_on_new_weights_and_flushes_after_them(tmp_path):
    engine, collective, _ = build(tmp_path, update_mode="keep")
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        fake = engine._engine
        fake.step_delay_s = 0.005
        request = asyncio.create_task(engine.sample([3], Sampling(temperature=1.0, max_tokens=30), n=1))
        await asyncio.sleep(0.03)
        group = collective.open_group(ADDRESS, PORT, GROUP_NAME, world_size=2)
        group.broadcast(list(new.items()))
        await engine.receive_weights(message(1, new, group_spec()))
        assert request.done()  # admission reopened only after the kept request drained
        return await request, fake

    (completion,), fake = run(main())
    assert completion.finish_reason == "length" and len(completion.versions) == 30
    assert completion.versions[0] == 0 and completion.versions[-1] == 1
    assert completion.versions == sorted(completion.versions)
    order = calls(fake)
    assert fake.calls[order.index("pause_generation")][1] == {"mode": "retract"}
    assert fake.calls[order.index("update_weights_from_distributed")][1]["flush_cache"] is False
    assert order[-1] == "flush_cache" and fake.dead is None


def test_load_weights_from_a_published_directory(tmp_path):
    engine, _, _ = build(tmp_path)
    new = weights_without_eos(1)
    directory = write_checkpoint(str(tmp_path / "v00000001"), new)

    async def main():
        await engine.start()
        await engine.load_from_disk(directory, 1)
        return await engine.sample([3], Sampling(temperature=1.0, max_tokens=3), n=1), engine._engine

    (completion,), fake = run(main())
    assert calls(fake) == ["pause_generation", "update_weights_from_disk", "flush_cache", "continue_generation"]
    assert fake.calls[1][1]["model_path"] == directory and completion.versions == [1, 1, 1]


def test_load_weights_from_a_staged_version(tmp_path):
    """The shared-memory path: a version published to the learner's ring and staged (verified) by the generator
    goes in with update_weights_from_tensor, under the same pause discipline."""
    from asyncrl.weightsync.publisher import WeightPublisher
    from asyncrl.weightsync.receiver import WeightStage

    engine, _, _ = build(tmp_path)
    new = weights_without_eos(2)
    publisher, stage = WeightPublisher(str(tmp_path / "ring"), 2, 1 << 16), WeightStage(str(tmp_path), "sg")
    specs = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in new.items()]
    staged = stage.stage(publisher.publish(iter(new.items()), 4, specs))

    async def main():
        await engine.start()
        await engine.load_weights(staged, None)
        return await engine.sample([3], Sampling(temperature=1.0, max_tokens=3), n=1), engine._engine

    try:
        (completion,), fake = run(main())
    finally:
        stage.close()
        publisher.close()
    assert calls(fake) == ["pause_generation", "update_weights_from_tensor", "flush_cache", "continue_generation"]
    assert all(torch.equal(fake.weights[name], tensor) for name, tensor in new.items())
    assert completion.versions == [4, 4, 4]


def test_server_args_map_the_engine_keywords_and_size_the_kv_pool_in_tokens(tmp_path):
    engine, _, model_dir = build(tmp_path, attention_backend="triton")
    args = engine.server_args()
    assert {k: args[k] for k in ("model_path", "dtype", "context_length", "random_seed", "skip_tokenizer_init",
                                 "attention_backend")} == {
        "model_path": model_dir, "dtype": "float32", "context_length": 64, "random_seed": 0,
        "skip_tokenizer_init": True, "attention_backend": "triton"}
    # 2 (K and V) x 2 layers x 1 kv head x head_dim 4 x 4 bytes = 64 bytes per token
    assert kv_cache_tokens(model_dir, "float32", 1 / 1024, False) == (1 << 20) // 64
    assert args["max_total_tokens"] == int(0.001 * (1 << 30)) // 64


def test_make_engine_builds_the_sglang_engine_and_says_when_sglang_is_missing(tmp_path):
    kwargs = dict(model_path=str(tmp_path), dtype="float32", max_model_len=64, kv_cache_gib=0.1, seed=0)
    assert isinstance(make_engine("sglang", engine_factory=FakeSglangEngine, **kwargs), SglangEngine)
    try:
        import sglang  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="SGLang cannot be imported"):
            make_engine("sglang", **kwargs)
