"""The sglang engine and its weight receiver against the faithful fake (tests/fakes/fake_sglang.py).

Versions come in as the generator hands them over: a `Staged` version (weightsync/receiver.py) loaded with
`load_weights(staged, fallback)`. Most tests build one in process memory with the real Staged and FlatBuckets
(`staged_version`); one goes through the real WeightPublisher and WeightStage end to end.
"""
import asyncio
import re

import pytest
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.generator.engines.base import EngineBroken, EngineOptions, SglangOptions, WeightLoadError
from asyncrl.generator.engines.factory import make_engine
from asyncrl.generator.engines.sglang_engine import SglangEngine, kv_cache_tokens, new_tokens
from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.dtypes import dtype_name
from asyncrl.weightsync.layout import announcement_for, bucket_checksum, plan_layout
from asyncrl.weightsync.receiver import Staged
from tests.fakes.fake_sglang import FakeSglangEngine
from tests.fakes.sglang_setup import build, weights_without_eos


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    """A bounded wait on a condition (never a fixed sleep: the machine's speed varies too much)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


def staged_version(version: int, weights: dict, slot: int = 0) -> Staged:
    """`weights` as WeightStage hands a verified version to an engine: the real Staged, FlatBuckets and announcement,
    with the buckets in process memory instead of a staging slot (the receiver reads only the buckets)."""
    named = list(weights.items())
    layout = plan_layout([(name, dtype_name(tensor.dtype), tuple(tensor.shape)) for name, tensor in named], 1 << 16)
    buckets = FlatBuckets(layout)
    for name, tensor in named:
        buckets.put(name, tensor)
    message = announcement_for(layout, version, [bucket_checksum(buffer) for buffer in buckets.buffers],
                               publisher="life-1", published_at=0.0)
    return Staged(version, message, ring_path="", slot=slot, buckets=buckets)


def calls(fake) -> list:
    return [name for name, _ in fake.calls]


def holds(fake, weights: dict) -> bool:
    return all(torch.equal(fake.weights[name], tensor) for name, tensor in weights.items())


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_sampling_returns_token_ids_processed_logprobs_and_versions(tmp_path):
    engine, _ = build(tmp_path)

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
    engine, _ = build(tmp_path)

    async def main():
        await engine.start()
        return await engine.sample([3, 5], Sampling(temperature=0.0, max_tokens=4), n=1)

    (completion,) = run(main())
    assert completion.logprobs == [0.0] * 4 and len(completion.token_ids) == 4


def test_top_k_or_top_p_sampling_is_refused_because_sglang_logprobs_ignore_them(tmp_path):
    engine, _ = build(tmp_path)

    async def main():
        await engine.start()
        for sampling in (Sampling(temperature=1.0, top_k=5), Sampling(temperature=1.0, top_p=0.9)):
            with pytest.raises(ValueError, match="top-k/top-p"):
                await engine.sample([3], sampling, n=1)

    run(main())


def test_incremental_and_cumulative_stream_chunks_give_the_same_completion(tmp_path):
    results = []
    for incremental in (False, True):
        engine, _ = build(tmp_path / str(incremental), incremental_streaming_output=incremental)

        async def main():
            await engine.start()
            return await engine.sample([3, 5], Sampling(temperature=1.0, max_tokens=8), n=1)

        results.append(run(main())[0])
    assert results[0] == results[1]
    assert new_tokens({"completion_tokens": 3, "output_token_logprobs": [(-1.0, 4, None)]}, 2) == [(-1.0, 4)]
    assert new_tokens({"completion_tokens": 3, "output_token_logprobs": [(-1, 1), (-2, 2), (-3, 3)]}, 1) == [
        (-2, 2), (-3, 3)]


def test_load_pauses_loads_flushes_continues_in_order_and_bumps_versions(tmp_path):
    engine, _ = build(tmp_path)
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        await engine.load_weights(staged_version(1, new), None)
        return await engine.sample([3, 5], Sampling(temperature=1.0, max_tokens=5), n=2), engine._engine

    completions, fake = run(main())
    assert calls(fake) == ["pause_generation", "update_weights_from_tensor", "flush_cache", "continue_generation"]
    assert fake.calls[0][1] == {"mode": "abort"}
    assert fake.calls[1][1] == {"names": list(new), "flush_cache": True, "weight_version": "1", "paused": True}
    assert engine.version == 1 and fake.weight_version() == "1" and holds(fake, new)
    assert all(completion.versions == [1] * 5 for completion in completions)


def test_failed_load_stays_paused_goes_back_to_the_model_files_and_never_serves_partial_weights(tmp_path):
    engine, model_dir = build(tmp_path)
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
        fake.fail_update_after = 1  # the embedding is written, the head is not: half-written weights
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_forever(stop))
        await wait_until(lambda: len(fake.tokens_served) >= 2)  # sampling is under way
        with pytest.raises(WeightLoadError, match="v1.*partially updated.*reloaded v0 from") as failure:
            await engine.load_weights(staged_version(1, new), None)
        after = await engine.sample([3], Sampling(temperature=1.0, max_tokens=4), n=1)
        stop.set()
        return fake, await sampler, after, failure.value

    fake, during, (after,), err = run(main())
    assert not isinstance(err, EngineBroken)
    order = calls(fake)
    failed, reload = order.index("update_weights_from_tensor"), order.index("update_weights_from_disk")
    assert "continue_generation" not in order[failed:reload]  # paused from the failure until the reload
    assert order[-1] == "continue_generation" and fake.calls[reload][1]["model_path"] == model_dir
    assert fake.partial is None and engine.version == 0 and fake.weight_version() == "0" and holds(fake, good)
    assert during and all(set(c.versions) <= {0} for c in during)  # the fake raises on any partial-weight forward
    assert after.versions == [0] * 4


def test_failed_load_goes_back_to_the_staged_fallback_not_the_model_files(tmp_path):
    engine, _ = build(tmp_path)
    v1, v2 = weights_without_eos(1), weights_without_eos(2)

    async def main():
        await engine.start()
        await engine.load_weights(staged_version(1, v1, slot=0), None)
        engine._engine.fail_update_after = 0
        with pytest.raises(WeightLoadError, match="could not load v2 .*reloaded v1 from staging slot 0"):
            await engine.load_weights(staged_version(2, v2, slot=1), staged_version(1, v1, slot=0))
        return await engine.sample([3], Sampling(temperature=1.0, max_tokens=3), n=1), engine._engine

    (completion,), fake = run(main())
    assert "update_weights_from_disk" not in calls(fake)
    assert engine.version == 1 and fake.weight_version() == "1" and fake.partial is None and holds(fake, v1)
    assert completion.versions == [1, 1, 1]


@pytest.mark.parametrize("fallback", ["model files", "staged"])
def test_failed_rollback_leaves_the_engine_paused_and_every_sample_and_load_raises(tmp_path, fallback):
    engine, _ = build(tmp_path)
    new = weights_without_eos(1)
    # the model's files cannot be read, or the staged fallback holds a tensor the model lacks: going back fails
    unloadable = staged_version(0, {"model.unknown.weight": torch.zeros(4)}) if fallback == "staged" else None
    target = "v0 from staging slot 0" if fallback == "staged" else "v0 from"

    async def main():
        await engine.start()
        engine._engine.fail_update_after, engine._engine.fail_disk_load = 0, True
        with pytest.raises(EngineBroken, match=f"rollback to {target}.* failed too"):
            await engine.load_weights(staged_version(1, new), unloadable)
        with pytest.raises(EngineBroken, match="restart it"):
            await engine.sample([3], Sampling(temperature=1.0, max_tokens=2), n=1)
        with pytest.raises(EngineBroken, match="v2 not loaded.*restart it"):
            await engine.load_weights(staged_version(2, new), None)
        return engine._engine

    fake = run(main())
    assert fake.paused and fake.partial is not None and calls(fake)[-1] != "continue_generation"


def test_load_timeout_names_the_engine_and_goes_back_to_the_model_files(tmp_path):
    engine, model_dir = build(tmp_path, timeout_s=0.2)
    new = weights_without_eos(1)
    timed_out = re.escape(f"load v1 from staging slot 0: no answer from sglang engine ({model_dir}) within 0.2s")

    async def main():
        await engine.start()
        engine._engine.update_delay_s = 1.0  # the load outlasts the receiver's timeout
        with pytest.raises(WeightLoadError, match=f"{timed_out}.*reloaded v0"):
            await engine.load_weights(staged_version(1, new), None)
        engine._engine.update_delay_s = 0.0
        await engine.load_weights(staged_version(2, new), None)
        return engine._engine

    fake = run(main())
    assert "update_weights_from_disk" in calls(fake) and engine.version == 2 and holds(fake, new)


def test_wait_mode_lets_in_flight_requests_finish_before_pausing(tmp_path):
    engine, _ = build(tmp_path, update_mode="wait")
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        engine._engine.step_delay_s = 0.005
        request = asyncio.create_task(engine.sample([3], Sampling(temperature=1.0, max_tokens=20), n=1))
        await wait_until(lambda: len(engine._engine.tokens_served) >= 2)  # the request is running
        await engine.load_weights(staged_version(1, new), None)
        return await request

    (completion,) = run(main())
    assert completion.finish_reason == "length" and completion.versions == [0] * 20


def test_abort_mode_returns_in_flight_requests_as_aborted(tmp_path):
    engine, _ = build(tmp_path, update_mode="abort")
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        engine._engine.step_delay_s = 0.005
        request = asyncio.create_task(engine.sample([3], Sampling(temperature=1.0, max_tokens=40), n=1))
        await wait_until(lambda: len(engine._engine.tokens_served) >= 3)  # the request is running
        await engine.load_weights(staged_version(1, new), None)
        return await request

    (completion,) = run(main())
    assert completion.finish_reason == "abort" and 0 < len(completion.token_ids) < 40
    assert completion.versions == [0] * len(completion.token_ids)


def test_keep_mode_finishes_kept_requests_on_new_weights_and_flushes_after_them(tmp_path):
    engine, _ = build(tmp_path, update_mode="keep")
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        fake = engine._engine
        fake.step_delay_s = 0.005
        request = asyncio.create_task(engine.sample([3], Sampling(temperature=1.0, max_tokens=30), n=1))
        await wait_until(lambda: len(fake.tokens_served) >= 3)  # the request is running
        await engine.load_weights(staged_version(1, new), None)
        assert request.done()  # admission reopened only after the kept request drained
        return await request, fake

    (completion,), fake = run(main())
    assert completion.finish_reason == "length" and len(completion.versions) == 30
    assert completion.versions[0] == 0 and completion.versions[-1] == 1
    assert completion.versions == sorted(completion.versions)
    order = calls(fake)
    assert fake.calls[order.index("pause_generation")][1] == {"mode": "retract"}
    assert fake.calls[order.index("update_weights_from_tensor")][1]["flush_cache"] is False
    assert order[-1] == "flush_cache" and fake.dead is None


def test_keep_mode_aborts_kept_requests_that_outlive_the_drain_then_flushes(tmp_path):
    engine, _ = build(tmp_path, update_mode="keep", drain_timeout_s=0.05)
    new = weights_without_eos(1)

    async def main():
        await engine.start()
        fake = engine._engine
        fake.step_delay_s = 0.005
        request = asyncio.create_task(engine.sample([3], Sampling(temperature=1.0, max_tokens=400), n=1))
        await wait_until(lambda: len(fake.tokens_served) >= 3)  # the request is running
        await engine.load_weights(staged_version(1, new), None)
        after = await engine.sample([3], Sampling(temperature=1.0, max_tokens=2), n=1)
        return await request, after, fake

    (kept,), (after,), fake = run(main())
    assert kept.finish_reason == "abort" and len(kept.token_ids) < 400
    assert kept.versions[0] == 0 and kept.versions[-1] == 1 and kept.versions == sorted(kept.versions)
    order = calls(fake)
    drained = order.index("continue_generation")  # the first continue lets the kept request run on v1
    assert order[drained + 1:drained + 4] == ["pause_generation", "flush_cache", "continue_generation"]
    assert fake.calls[drained + 1][1] == {"mode": "abort"} and fake.dead is None
    assert after.versions == [1, 1]


def test_a_version_staged_through_the_weight_stage_loads_from_shared_memory(tmp_path):
    """The production path end to end: a version published to the learner's ring and staged (copied and
    verified) by the generator's WeightStage goes in with update_weights_from_tensor."""
    from asyncrl.weightsync.publisher import WeightPublisher
    from asyncrl.weightsync.receiver import WeightStage

    engine, _ = build(tmp_path)
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
    assert holds(fake, new) and completion.versions == [4, 4, 4]


def test_server_args_map_the_engine_keywords_and_size_the_kv_pool_in_tokens(tmp_path):
    engine, model_dir = build(tmp_path, attention_backend="triton")
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
    faked = EngineOptions(**kwargs, sglang=SglangOptions(engine_factory=FakeSglangEngine))
    assert isinstance(make_engine("sglang", faked), SglangEngine)
    try:
        import sglang  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="SGLang cannot be imported"):
            make_engine("sglang", EngineOptions(**kwargs))
