"""The real SGLang engine on the tiny demo Qwen2: sampling, then one version received over a torch.distributed group.

Needs CUDA and SGLang (skipped otherwise). The learner's end of the group runs in a thread of this process and
joins with SGLang's own `init_custom_process_group`, because the engine's end prefixes the store keys with the
group name. NCCL refuses two ranks on one GPU, so the NCCL case needs two GPUs (the engine takes GPU 1); the gloo
case runs on one and still exercises the same receiver path with CUDA tensors.
"""
import asyncio
import threading

import numpy as np
import pytest
import torch

from asyncrl.buffer.group import Sampling
from tests.conftest import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GROUP_NAME = "asyncrl-test-weights"


def learner_group_init():
    """SGLang's helper for the trainer's end of a weight-update group (its module moved between releases)."""
    pytest.importorskip("sglang")
    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError:
        from sglang.srt.utils.common import init_custom_process_group
    return init_custom_process_group


def broadcast_version(backend: str, port: int, named_tensors: list, errors: list) -> None:
    """The learner: join the group as rank 0, then broadcast every tensor in the control message's order."""
    try:
        group = learner_group_init()(backend=backend, init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                     group_name=GROUP_NAME)
        for _, tensor in named_tensors:
            torch.distributed.broadcast(tensor, src=0, group=group)
        torch.cuda.synchronize()
    except Exception as err:  # reported to the test thread
        errors.append(err)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_real_sglang_samples_then_receives_a_version_over_a_process_group(demo_assets, backend):
    learner_group_init()
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL will not put two ranks on one GPU; the nccl case needs two")
    from asyncrl.generator.engines.sglang_engine import SglangEngine
    from asyncrl.learner.model import load_model

    model_dir = demo_assets[0]
    engine = SglangEngine(model_dir, "bfloat16", max_model_len=64, kv_cache_gib=0.25, seed=0, timeout_s=300,
                          server_args={"attention_backend": "triton", "disable_cuda_graph": True,
                                       "mem_fraction_static": 0.3, "base_gpu_id": 1 if backend == "nccl" else 0})
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    try:
        prompt = [5, 7, 9, 3]
        before = loop.run_until_complete(engine.sample(prompt, Sampling(temperature=0.7, max_tokens=8), n=2))
        for completion in before:
            assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) > 0
            assert set(completion.versions) == {0} and all(lp <= 0 for lp in completion.logprobs)

        generator = torch.Generator().manual_seed(1)
        named = [(name, (param.detach() + 0.05 * torch.randn(param.shape, generator=generator)).to(
            device="cuda:0", dtype=torch.bfloat16)) for name, param in load_model(model_dir).named_parameters()]
        port = free_port()
        message = {"version": 1, "names": [n for n, _ in named], "dtypes": ["bfloat16"] * len(named),
                   "shapes": [list(t.shape) for _, t in named],
                   "group": {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "rank_offset": 1,
                             "group_name": GROUP_NAME, "backend": backend, "generation": 1}}
        errors: list = []
        learner = threading.Thread(target=broadcast_version, args=(backend, port, named, errors), daemon=True)
        learner.start()
        loop.run_until_complete(engine.receive_weights(message))
        learner.join(timeout=120)
        assert not errors and not learner.is_alive()
        assert engine.version == 1

        sent = dict(named)["model.norm.weight"].float().cpu().numpy()
        got = np.asarray(loop.run_until_complete(engine._engine.get_weights_by_name("model.norm.weight", 100)),
                         dtype=np.float32).reshape(-1)
        np.testing.assert_allclose(got, sent[: got.size], atol=1e-2)
        after = loop.run_until_complete(engine.sample(prompt, Sampling(temperature=0.7, max_tokens=8), n=2))
        assert all(set(completion.versions) == {1} for completion in after)
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
