"""The engine push for real (weightsync.backend=engine_push): the learner side in this process on GPU 0 (vLLM's
NCCL trainer engine, or SGLang's weight-update group opened with SGLang's own helper), a generator in a child
process on GPU 1 (NCCL wants one GPU per rank) with vLLM or SGLang on CUDA, registered through
generator/weights.py. A version perturbed on the learner is pushed; after it the engine
samples the new weights' distribution and tags every token with the new version. Needs two GPUs and the `gpu`
extra's engines; scripts/test_gpu runs it (skipped on one GPU)."""
import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.helpers import BF16_TOLERANCE, PROMPT, learner_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def generator_side(kind: str, model_path: str, address: str, shm_dir: str, last: str) -> None:
    """The child: a vLLM or SGLang engine on its GPU, registered for pushes; prints one JSON line after the
    first pushed version."""
    from asyncrl.buffer.group import Sampling
    from asyncrl.generator.engines.base import EngineOptions, SglangOptions, VllmOptions
    from asyncrl.generator.weights import join_push
    from asyncrl.weightsync.receiver import WeightStage

    if kind == "vllm":
        from asyncrl.generator.engines.vllm_engine import VllmEngine

        engine = VllmEngine(EngineOptions(model_path, dtype="bfloat16", max_model_len=64, kv_cache_gib=0.25,
                                          seed=0, vllm=VllmOptions(gpu_memory_utilization=0.2)))
    else:
        from asyncrl.generator.engines.sglang_engine import SglangEngine

        engine = SglangEngine(EngineOptions(model_path, dtype="bfloat16", max_model_len=64, kv_cache_gib=0.25,
                                            seed=0, sglang=SglangOptions(server_args={"mem_fraction_static": 0.2})))
    await engine.start()
    member, _ = await join_push({"engines": {"address": address}}, engine, asyncio.Lock(), lambda: {},
                                WeightStage(shm_dir, "push-gpu"), "push-gpu", 60.0)
    print(json.dumps({"ready": True}), flush=True)
    seen = 0
    while engine.version < int(last):
        await asyncio.sleep(0.1)
    while seen < 1:
        completion, = await engine.sample(PROMPT, Sampling(temperature=0.7, max_tokens=8), n=1)
        print(json.dumps({"version": engine.version, "tokens": completion.token_ids,
                          "logprobs": completion.logprobs, "versions": completion.versions}), flush=True)
        seen += 1
    member.close()
    await engine.close()


@pytest.mark.parametrize("kind, transport", [("vllm", "nccl"), ("vllm", "sparse_nccl"), ("sglang", "nccl"),
                                             ("vllm", "ipc")])
def test_a_pushed_version_is_what_the_engine_samples(kind, transport, demo_assets, tmp_path):
    """NCCL wants one GPU per rank (the engine on GPU 1); IPC wants the engine on the learner's GPU (GPU 0)."""
    pytest.importorskip(kind)
    if transport != "ipc" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0" if transport == "ipc" else "1"}
    if transport == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # as VllmEngine.start sets it (VllmOptions.ipc_push)
    from asyncrl.learner.model import load_model
    from asyncrl.weightsync.buckets import FlatBuckets
    from asyncrl.weightsync.engine_push.sender import EnginePushSender
    from asyncrl.weightsync.layout import plan_layout

    torch.cuda.set_device(0)
    host = EnginePushSender(heartbeat_timeout_s=30.0, transport=transport)
    child = subprocess.Popen(
        [sys.executable, "-c", "import asyncio, sys; from tests.gpu.test_engine_push_real import generator_side; "
                               "asyncio.run(generator_side(*sys.argv[1:]))", kind, demo_assets[0], host.address,
         str(tmp_path), "2" if transport == "sparse_nccl" else "1"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert json.loads(child.stdout.readline()).get("ready")
        model = load_model(demo_assets[0]).to("cuda", torch.bfloat16).eval()
        generator = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator, device="cuda", dtype=param.dtype))
        state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        layout = plan_layout([(name, "bfloat16", tuple(t.shape)) for name, t in state.items()], 1 << 24)
        buckets = FlatBuckets(layout, device="cuda")
        for name, tensor in state.items():
            buckets.put(name, tensor)
        report = host.send(1, buckets, timeout_s=120)
        assert report.ok and report.delivered == ["push-gpu"], report
        last = 1
        if transport == "sparse_nccl":  # v1 went dense (nothing to diff against); v2 goes as patches
            with torch.no_grad():
                head = next(p for n, p in model.named_parameters() if n.endswith("lm_head.weight") or "embed" in n)
                head.view(-1)[:64] += 0.5
            for name, tensor in model.state_dict().items():
                buckets.put(name, tensor)
            report = host.send(2, buckets, timeout_s=120)
            assert report.ok, report
            last = 2
        line = json.loads(child.stdout.readline())
        assert line["version"] == last and set(line["versions"]) == {last}
        with torch.no_grad():
            gap = float((learner_logprobs(model, line["tokens"]) - torch.tensor(line["logprobs"]).numpy()).__abs__()
                        .max())
        assert gap < BF16_TOLERANCE  # the pushed weights' distribution
    finally:
        host.close()
        child.stdin and child.stdin.close()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
