"""Routing replay through the real pieces on CPU: the hf engine samples a tiny Qwen3-MoE and records the experts of
every token, the group crosses the wire codec under the job's limits, and the learner's logprobs, computed on the
sampler's routes, match the engine's on every token within 1e-4; without replay the mismatch is reported. vLLM
returns routes only on a GPU (its Model Runner V2 needs Triton): tests/gpu/test_gpu_moe_routing.py."""
import asyncio
import time

import numpy as np
import pytest
import torch

from asyncrl.buffer.codec import decode_group, encode_group
from asyncrl.buffer.group import Group, Sample, Sampling, route_dtype
from asyncrl.buffer.plausibility import JobLimits
from asyncrl.generator.engines.base import EngineOptions
from asyncrl.generator.engines.hf_engine import HfEngine
from asyncrl.learner.batch import build_batch
from asyncrl.learner.families import build_family_model
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import load_model, load_tokenizer
from asyncrl.moe.routing import RoutingReplay, routing_shape

PROMPTS = ([5, 7, 9, 11, 4, 6], [8, 10, 12, 3, 5, 7, 9, 13, 6])
SAMPLING = Sampling(temperature=1.0, max_tokens=10)


@pytest.fixture(scope="module")
def moe_dir(demo_assets, tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, top 2, 2 layers) at its random init, whose router scores sit close together:
    the ties a few ulps of numerics can flip are common."""
    tokenizer = load_tokenizer(demo_assets[0])
    model = build_family_model("qwen3_moe", len(tokenizer), hidden_size=64, num_layers=2, max_positions=64)
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def sampled_group(path: str) -> tuple[Group, list]:
    """Two prompts of different lengths, two samples each, decoded in one left-padded batch of the hf engine."""
    async def run():
        engine = HfEngine(EngineOptions(path, "float32", max_model_len=64, kv_cache_gib=0.0, seed=3,
                                        record_routes=True))
        await engine.start()
        try:
            return await asyncio.gather(*(engine.sample(prompt, SAMPLING, 2) for prompt in PROMPTS))
        finally:
            await engine.close()

    per_prompt = asyncio.run(run())
    groups = []
    for prompt, completions in zip(PROMPTS, per_prompt):
        samples = [Sample(completion_ids=np.asarray(c.token_ids, dtype=np.int32),
                          logprobs=np.asarray(c.logprobs, dtype=np.float32),
                          versions=np.asarray(c.versions, dtype=np.int32), reward=0.0,
                          finish_reason=c.finish_reason, routed_experts=c.routed_experts) for c in completions]
        groups.append(Group(group_id=f"g{len(prompt)}", prompt_id="p", generator_id="gen",
                            prompt_ids=np.asarray(prompt, dtype=np.int32), samples=samples, sampling=SAMPLING,
                            created_at=time.time()))
    return groups


def test_the_learner_on_the_samplers_routes_matches_the_engines_logprobs(moe_dir):
    model = load_model(moe_dir).eval()
    shape = routing_shape(model.config)
    limits = JobLimits(group_size=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=10, max_completion_tokens=10,
                       max_prompt_tokens=32, max_positions=64, routing=shape)
    groups = []
    for group in sampled_group(moe_dir):
        for sample in group.samples:
            routes = sample.routed_experts
            assert routes.dtype == route_dtype(shape[2]) == np.uint8
            assert routes.shape == (len(group.prompt_ids) + len(sample.completion_ids) - 1, shape[0], shape[1])
            assert int(routes.max()) < shape[2]
        wire = decode_group(encode_group(group), vocab_size=model.config.vocab_size, max_version=0,
                            max_message_bytes=1 << 20, limits=limits)
        for sent, got in zip(group.samples, wire.samples):
            np.testing.assert_array_equal(got.routed_experts, sent.routed_experts)
        groups.append(wire)
    batch = build_batch(groups)
    replay = RoutingReplay(model, *shape)
    mask = batch.loss_mask.bool()

    def against_the_sampler() -> dict:
        """mode -> (max |ℓθ - ℓμ|, offpolicy/mismatch_k3's estimator) over the batch's sampled tokens."""
        out = {}
        for mode, routes in (("replay", batch.routed_experts), ("own routes", None)):
            replay.set_routes(routes)
            with torch.no_grad():
                logprobs, _ = compute_logprobs(model.eval(), batch.input_ids, batch.attention_mask,
                                               batch.temperatures, 64)
            diff = (logprobs - batch.logprobs_behav)[mask]
            out[mode] = (float(diff.abs().max()), float((diff.exp() - 1 - diff).mean()))
        replay.set_routes(None)
        return out

    at_version = against_the_sampler()
    print(f"\nrouting replay on {int(mask.sum())} tokens at the sampling version: (max |Δ logprob|, k3) {at_version}")
    assert at_version["replay"][0] < 1e-4, at_version
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):  # two versions later: the routers moved, and with them the learner's own routes
        torch.manual_seed(step)
        ids = torch.randint(3, model.config.vocab_size, (4, 16))
        optimizer.zero_grad()
        model.train()(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    stale = against_the_sampler()
    print(f"two versions later: (max |Δ logprob|, k3) {stale}")
    assert all(np.isfinite(value) for pair in stale.values() for value in pair)
    replay.remove()


@pytest.mark.slow
def test_a_job_with_routing_replay_trains_on_the_routes_its_generator_recorded(moe_dir, demo_assets, tmp_path):
    """`asyncrl run` on the tiny MoE with learner.moe_routing_replay: the learner tells the generator (run info),
    the hf engine records, every group crosses the wire with its routes (none rejected), and the learner trains on
    them. At η = 0 with π_prox recomputed, the learner's logprobs on the replayed routes at the sampling version
    are the generator's within 1e-4 on every token (routes shifted by one position would send most tokens to other
    experts and break that)."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import free_port
    from tests.e2e.jobs import QUIET_TELEMETRY

    job_dir = tmp_path / "job"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ASYNCRL_JOB_DIR": str(job_dir),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    run = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", "--config", "demo_cpu.yaml", "demo=null",
                          f"model.path={moe_dir}", f"data.train_files=[{demo_assets[1][0]}]",
                          "learner.moe_routing_replay=true", "learner.total_steps=3", "buffer.groups_per_step=2",
                          "rollout.n=2", "generator.max_inflight_groups=2", f"buffer.port={free_port()}",
                          "algo.dynamic_sampling=false", "eval.every_steps=0", "eval.before_train=false",
                          "buffer.max_staleness=0", "algo.prox_logprobs=recompute",
                          "learner.autocast=",  # fp32: the replayed routes' logprobs are matched to 1e-4 below
                          *QUIET_TELEMETRY], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in open(job_dir / "progress.jsonl")]
    assert len(rows) == 3
    last = rows[-1]
    assert not any(key.startswith("buffer/rejected/") and value for key, value in last.items()), last
    assert last["loss/pg"] == last["loss/pg"]  # trained (finite)
    assert max(row["offpolicy/abs_diff/max"] for row in rows) < 1e-4
