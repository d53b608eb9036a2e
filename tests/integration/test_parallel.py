"""The learner on several real gloo ranks (FSDP2, Ulysses, both) against one process: same loss, same gradients.

Each case spawns its ranks as processes (torch.multiprocessing), trains one step on the same groups from the same
initial weights, and rank 0 writes the step's metrics and the full gradients it gathered to a file.
"""
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.algos.config import AlgoConfig
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.learner.batch import assign_rows, build_batch, plan_microbatches
from asyncrl.learner.families import FAMILIES, build_family_model
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.parallel import ParallelConfigError, ParallelState, apply_fsdp, build_parallel_state
from asyncrl.learner.publish import bucket_names, iter_full_weights
from asyncrl.learner.sft import sft_step
from asyncrl.learner.sft_data import SFTExample
from asyncrl.learner.train_step import StepSettings, train_step
from asyncrl.learner.ulysses import UlyssesConfigError, apply_ulysses, check_heads
from tests.conftest import free_port

VOCAB = 40


def make_groups(seed: int, num_groups: int = 4, n: int = 3) -> list:
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(num_groups):
        prompt = rng.integers(2, VOCAB, size=rng.integers(2, 7)).astype(np.int32)
        samples = []
        for _ in range(n):
            length = int(rng.integers(1, 12))
            samples.append(Sample(completion_ids=rng.integers(2, VOCAB, size=length).astype(np.int32),
                                  logprobs=-rng.random(length).astype(np.float32) * 3,
                                  versions=np.zeros(length, dtype=np.int32), reward=float(rng.integers(0, 2)),
                                  finish_reason="stop"))
        groups.append(Group(group_id=str(index), prompt_id="p", generator_id="t", prompt_ids=prompt, samples=samples,
                            sampling=Sampling(temperature=0.8), created_at=time.time()))
    return groups


def sft_examples(seed: int, count: int = 7) -> list:
    """Conversations of varied length whose trained tokens come in spans (assistant turns)."""
    rng = np.random.default_rng(seed)
    examples = []
    for index in range(count):
        length = int(rng.integers(4, 20))
        mask = np.zeros(length, dtype=int)
        start = int(rng.integers(1, length - 1))
        mask[start:] = 1
        examples.append(SFTExample(input_ids=rng.integers(2, VOCAB, length).tolist(), loss_mask=mask.tolist(),
                                   source=f"synthetic:{index}"))
    return examples


def tiny_model(heads: int = 4, kv_heads: int = 2, family: str | None = None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if family is not None:
        return build_family_model(family, VOCAB, heads=heads, kv_heads=kv_heads)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def run_step(model, parallel: ParallelState, case: dict) -> tuple[dict, dict]:
    """One train_step; returns its metrics and the full gradients seen just before the optimizer step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    grads = {}

    def capture(opt, args, kwargs):
        for name, param in model.named_parameters():
            grad = param.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[name] = grads.get(name, 0) + grad.detach().clone()

    optimizer.register_step_pre_hook(capture)
    settings = StepSettings(version=0, max_staleness=4, max_tokens_per_microbatch=case["budget"], chunk_tokens=7,
                            grad_clip=1.0, packing=case["packing"], parallel=parallel)
    if case.get("sft"):
        return {"loss/pg": sft_step(model, optimizer, sft_examples(case["seed"]), settings)}, grads
    algo = AlgoConfig(ppo_minibatches=case["minibatches"], entropy_coef=case.get("entropy_coef", 0.0))
    metrics = train_step(model, optimizer, scheduler, make_groups(case["seed"]), algo, settings)
    return metrics, grads


def worker(rank: int, world: int, port: int, case: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel = build_parallel_state(case["sp"])
        model = tiny_model(case["heads"], case["kv_heads"], case.get("family"))
        if parallel.sp_size > 1:
            attention = apply_ulysses(model, parallel.sp_group, parallel.sp_size, case.get("sp_impl", "native"))
            if case.get("sp_impl") == "deepspeed":  # DeepSpeed's exchange, not ours, carries the attention
                from deepspeed.sequence.layer import DistributedAttention
                assert isinstance(attention.keywords["exchange"], DistributedAttention)
        apply_fsdp(model, parallel, param_dtype=case.get("param_dtype", "float32"),
                   activation_checkpointing=case.get("ac", False))
        published = dict(iter_full_weights(model, parallel, torch.float32, bucket_bytes=20_000))
        metrics, grads = run_step(model, parallel, case)
        if rank == 0:
            torch.save({"metrics": metrics, "grads": grads, "published": published}, out)
        dist.barrier()  # both ranks leave together: tearing gloo down while a peer still talks can abort
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, case: dict, tmp_path) -> dict:
    out = str(tmp_path / f"rank0-{world}-{case['sp']}.pt")
    mp.start_processes(worker, args=(world, free_port(), case, out), nprocs=world, start_method="spawn", join=True)
    return torch.load(out)


def reference(case: dict) -> dict:
    torch.set_num_threads(1)
    metrics, grads = run_step(tiny_model(case["heads"], case["kv_heads"], case.get("family")), ParallelState(), case)
    return {"metrics": metrics, "grads": grads}


def assert_same_step(got: dict, expected: dict, tol: float = 1e-5) -> None:
    """The step's loss and every full gradient agree within `tol`."""
    assert abs(got["metrics"]["loss/pg"] - expected["metrics"]["loss/pg"]) < tol
    assert set(got["grads"]) == set(expected["grads"])
    for param, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][param], grad, atol=tol, rtol=0, msg=param)


CASES = {
    "fsdp2": dict(world=2, sp=1),
    "sp2": dict(world=2, sp=2),
    "fsdp2xsp2": dict(world=4, sp=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("packing,minibatches", [(False, 1), (True, 2)])
def test_ranks_match_one_process(name, packing, minibatches, tmp_path):
    case = dict(seed=3, budget=40, packing=packing, minibatches=minibatches, heads=4, kv_heads=2, sp=CASES[name]["sp"])
    expected = reference(case)
    got = run_ranks(CASES[name]["world"], case, tmp_path)
    for key in ("loss/pg", "loss/total", "policy/grad_norm", "policy/entropy", "offpolicy/mismatch_k3", "policy/ppo_kl"):
        assert abs(got["metrics"][key] - expected["metrics"][key]) < 1e-5, (key, got["metrics"][key],
                                                                            expected["metrics"][key])
    assert set(got["grads"]) == set(expected["grads"])
    for param, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][param], grad, atol=1e-5, rtol=0, msg=param)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp2"])
def test_the_entropy_bonus_on_ranks_matches_one_process(name, tmp_path):
    """algo.entropy_coef's gradient through the gathered sequence (Ulysses SP = 2; the head is FSDP2-sharded on
    both ranks). The data-parallel sum of the step's loss shares is the one test_ranks_match_one_process runs."""
    case = dict(seed=5, budget=40, packing=False, minibatches=1, heads=4, kv_heads=2, sp=CASES[name]["sp"],
                entropy_coef=0.05)
    got, expected = run_ranks(CASES[name]["world"], case, tmp_path), reference(case)
    assert_same_step(got, expected)
    assert got["metrics"]["loss/entropy"] == pytest.approx(expected["metrics"]["loss/entropy"], abs=1e-5)
    assert expected["metrics"]["loss/entropy"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", [family for family in FAMILIES if family != "qwen2"])
@pytest.mark.parametrize("name", ["fsdp2", "sp2"])
def test_each_model_family_on_two_ranks_matches_one_process(family, name, tmp_path):
    """Qwen3, Llama 3, Mistral (sliding window 8, crossed by these sequences), Gemma 2 (soft-capping, alternating
    sliding layers, eager attention) and Qwen3-MoE, packed, under FSDP2 and under Ulysses SP = 2: the loss and every
    gradient within 1e-5 of one process."""
    case = dict(seed=7, budget=64, packing=True, minibatches=1, heads=4, kv_heads=2, sp=CASES[name]["sp"],
                family=family)
    expected = reference(case)
    got = run_ranks(2, case, tmp_path)
    assert_same_step(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_deepspeed_ulysses_matches_one_process(family, tmp_path):
    """learner.sp_impl=deepspeed: DeepSpeed's DistributedAttention does the all-to-alls on 2 gloo ranks, packed
    (Gemma 2: soft-capping and sliding windows reach the inner attention through it); the loss and every gradient
    within 1e-5 of one process."""
    case = dict(seed=7, budget=64, packing=True, minibatches=1, heads=4, kv_heads=2, sp=2, sp_impl="deepspeed",
                family=None if family == "qwen2" else family)
    expected = reference(case)
    got = run_ranks(2, case, tmp_path)
    assert_same_step(got, expected)


@pytest.mark.slow
def test_ulysses_repeats_kv_heads_when_sp_does_not_divide_them(tmp_path):
    case = dict(seed=5, budget=64, packing=False, minibatches=1, heads=4, kv_heads=1, sp=2)
    assert check_heads(tiny_model(4, 1).config, 2) == 4
    expected = reference(case)
    got = run_ranks(2, case, tmp_path)
    assert_same_step(got, expected)


@pytest.mark.slow
def test_sft_on_fsdp2_and_ulysses_matches_one_process(tmp_path):
    case = dict(seed=7, budget=24, packing=True, minibatches=1, heads=4, kv_heads=2, sp=2, sft=True)
    expected = reference(case)
    got = run_ranks(4, case, tmp_path)
    assert_same_step(got, expected)


@pytest.mark.slow
def test_activation_checkpointing_matches_and_published_weights_are_whole(tmp_path):
    case = dict(seed=11, budget=40, packing=False, minibatches=1, heads=4, kv_heads=2, sp=1, ac=True)
    expected = reference(case)
    got = run_ranks(2, case, tmp_path)
    assert_same_step(got, expected)
    full = tiny_model().state_dict()  # what rank 0 published before the step: every tensor whole, tied ones too
    assert set(got["published"]) == set(full)
    for name, tensor in full.items():
        assert torch.equal(got["published"][name], tensor), name


@pytest.mark.slow
def test_bf16_mixed_precision_trains_close_to_fp32(tmp_path):
    case = dict(seed=3, budget=40, packing=False, minibatches=1, heads=4, kv_heads=2, sp=1, param_dtype="bfloat16")
    expected = reference(case)
    got = run_ranks(2, case, tmp_path)
    assert abs(got["metrics"]["loss/pg"] - expected["metrics"]["loss/pg"]) < 0.05
    assert got["metrics"]["policy/grad_norm"] > 0


def test_publish_buckets_hold_about_the_asked_bytes():
    tensors = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(100), "d": torch.zeros(5)}
    assert bucket_names(tensors, 80) == [["a", "b"], ["c"], ["d"]]


def test_cpu_offload_on_a_cpu_learner_is_a_clear_error():
    parallel = ParallelState(world_size=2, dp_size=2, device="cpu")
    with pytest.raises(ParallelConfigError, match="cpu_offload"):
        apply_fsdp(tiny_model(), parallel, cpu_offload=True)


def test_sp_size_that_does_not_divide_the_heads_is_a_clear_error():
    with pytest.raises(UlyssesConfigError, match="sp_size=3 does not divide the model's 4 attention heads"):
        check_heads(tiny_model(4, 2).config, 3)


def test_rows_are_balanced_by_tokens_and_every_rank_runs_as_many_passes():
    lengths = [30, 3, 3, 3, 25, 4, 2, 28]
    shares = assign_rows(lengths, 2)
    assert sorted(r for share in shares for r in share) == list(range(8))
    loads = [sum(lengths[r] for r in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(lengths)  # longest-first greedy bound
    batch = build_batch(make_groups(1, num_groups=3, n=3))
    plans = [plan_microbatches(batch, 24, rank, 2) for rank in range(2)]
    assert len(plans[0]) == len(plans[1])
    rows = sorted(int(r) for plan in plans for micro in plan if micro is not None for r in micro.rows)
    assert rows == list(range(batch.num_rows))
    for plan in plans:
        for micro in plan:
            if micro is not None and micro.num_rows > 1:
                assert micro.num_rows * micro.input_ids.shape[1] <= 24
