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
from asyncrl.learner.config import CriticConfig, LoraSettings
from asyncrl.learner.critic import Critic
from asyncrl.learner.families import FAMILIES, build_family_model
from asyncrl.learner.parallel import ParallelConfigError, ParallelState, apply_fsdp, build_parallel_state
from asyncrl.learner.lora import apply_lora, trainable_parameters
from asyncrl.learner.publish import bucket_names, iter_full_weights
from asyncrl.learner.sft import sft_step
from asyncrl.data.sft import SFTExample
from asyncrl.learner.train_step import StepSettings, train_step
from asyncrl.learner.ulysses import UlyssesConfigError, apply_ulysses, check_heads
from asyncrl.weightsync.lora_names import is_adapter_key
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


VISION_IDS = {"<|vision_start|>": 3, "<|vision_end|>": 4, "<|image_pad|>": 5, "<|video_pad|>": 6}
"""The tiny vision-language model's placeholder tokens; the groups' text tokens are 7 and up."""


def tiny_vlm():
    """(the vision demo's Qwen2.5-VL shape over VOCAB tokens, its VisionProcessor), the same in every process."""
    from types import SimpleNamespace

    from asyncrl.data.vision import VisionProcessor
    from asyncrl.learner.init_model import build_vision_model

    tokenizer = SimpleNamespace(convert_tokens_to_ids=VISION_IDS.get, unk_token_id=1, eos_token_id=2, pad_token_id=0)
    model, processor = build_vision_model("qwen2_5_vl", VOCAB, tokenizer, seed=0)
    return model, VisionProcessor(processor, VISION_IDS["<|image_pad|>"], 1 << 22)


def vlm_groups(seed: int, num_groups: int = 4, n: int = 3) -> list:
    """Groups whose prompts hold one 56x56 image each (4 image pads), but the last, whose long rows have none."""
    import random

    from asyncrl.generator.tasks.square_colour import draw

    groups = make_groups(seed, num_groups, n)
    rng = np.random.default_rng(seed)
    for index, group in enumerate(groups[:-1]):
        text = rng.integers(7, VOCAB, size=3).astype(np.int32)
        group.prompt_ids = np.concatenate([[3, 5, 4], text]).astype(np.int32)
        group.images = [draw("rgby"[index % 4], random.Random(seed + index))]
        for sample in group.samples:
            sample.completion_ids = np.maximum(sample.completion_ids, 7).astype(np.int32)
    groups[-1].prompt_ids = np.maximum(groups[-1].prompt_ids, 7).astype(np.int32)
    for sample in groups[-1].samples:
        sample.completion_ids = np.maximum(sample.completion_ids, 7).astype(np.int32)
        sample.completion_ids = np.concatenate([sample.completion_ids, [7] * 20]).astype(np.int32)[:30]
        sample.logprobs = -np.ones(len(sample.completion_ids), np.float32)
        sample.versions = np.zeros(len(sample.completion_ids), np.int32)
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


def tiny_critic(heads: int = 4, kv_heads: int = 2):
    """PPO's value model on tiny_model's body: Qwen2 with a one-output token-classification head (random, so the
    body's gradients are not zero)."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation="sdpa", num_labels=1)
    config.classifier_dropout = 0.0
    torch.manual_seed(1)
    return Qwen2ForTokenClassification(config)


def capture_grads(model, optimizer) -> dict:
    """The full gradients seen just before each optimizer step, summed over the steps, by parameter name."""
    grads = {}

    def capture(opt, args, kwargs):
        for name, param in model.named_parameters():
            grad = param.grad
            if grad is None:  # frozen (the base model under LoRA)
                continue
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[name] = grads.get(name, 0) + grad.detach().clone()

    optimizer.register_step_pre_hook(capture)
    return grads


def run_step(model, parallel: ParallelState, case: dict, critic_model=None) -> tuple[dict, dict]:
    """One train_step; returns its metrics and the full gradients seen just before the optimizer step (the
    critic's under `critic/` when the case has one)."""
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    grads = capture_grads(model, optimizer)
    settings = StepSettings(version=0, max_staleness=4, max_tokens_per_microbatch=case["budget"], chunk_tokens=7,
                            grad_clip=1.0, packing=case["packing"], parallel=parallel,
                            vision=tiny_vlm()[1] if case.get("vlm") else None)
    if case.get("sft"):
        return {"loss/pg": sft_step(model, optimizer, sft_examples(case["seed"]), settings)}, grads
    critic, critic_grads = None, {}
    if critic_model is not None:
        critic_optimizer = torch.optim.AdamW(critic_model.parameters(), lr=1e-2)
        critic_grads = capture_grads(critic_model, critic_optimizer)
        critic = Critic(critic_model, critic_optimizer,
                        torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lambda step: 1.0),
                        CriticConfig(cliprange_value=0.05))
    algo = AlgoConfig(ppo_minibatches=case["minibatches"], entropy_coef=case.get("entropy_coef", 0.0),
                      advantage="gae" if critic is not None else "grpo")
    groups = vlm_groups(case["seed"]) if case.get("vlm") else make_groups(case["seed"])
    metrics = train_step(model, optimizer, scheduler, groups, algo, settings, critic=critic).metrics
    return metrics, {**grads, **{f"critic/{name}": grad for name, grad in critic_grads.items()}}


def run_case(rank: int, case: dict, out: str) -> None:
    """One case on this rank of a live process group: build, shard, train one step; rank 0 writes the result."""
    parallel = build_parallel_state(case["sp"])
    model = case_model(case)
    if parallel.sp_size > 1:
        attention = apply_ulysses(model, parallel.sp_group, parallel.sp_size, case.get("sp_impl", "native"))
        if case.get("sp_impl") == "deepspeed":  # DeepSpeed's exchange, not ours, carries the attention
            from deepspeed.sequence.layer import DistributedAttention
            assert isinstance(attention.keywords["exchange"], DistributedAttention)
    apply_fsdp(model, parallel, param_dtype=case.get("param_dtype", "float32"),
               activation_checkpointing=case.get("ac", False))
    critic = None
    if case.get("critic"):
        critic = tiny_critic(case["heads"], case["kv_heads"])
        if parallel.sp_size > 1:
            apply_ulysses(critic, parallel.sp_group, parallel.sp_size)
        apply_fsdp(critic, parallel)
    published = dict(iter_full_weights(model, parallel, torch.float32, bucket_bytes=20_000,
                                       keep=is_adapter_key if case.get("lora") else None))
    metrics, grads = run_step(model, parallel, case, critic)
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads, "published": published}, out)


def worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    """Every case of one rank layout in one process group, one after another: spawning ranks (and importing torch
    and transformers in each) costs more than most cases do. A case that raises is written as its error, and the
    group goes on to the next one (the ranks fail alike: they run the same code on the same data)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, case in cases.items():
            out = os.path.join(out_dir, f"{name}.pt")
            try:
                run_case(rank, case, out)
            except Exception as err:  # reported by the case's test, not by the whole layout
                if rank == 0:
                    torch.save({"error": f"{type(err).__name__}: {err}"}, out)
            dist.barrier()  # every rank done with the case before the next one builds its meshes
    finally:
        dist.destroy_process_group()


LAYOUTS = {"fsdp2": dict(world=2, sp=1), "sp2": dict(world=2, sp=2), "fsdp2xsp2": dict(world=4, sp=2)}
"""Rank layouts: FSDP2 over 2 ranks, Ulysses SP = 2, and both (4 ranks)."""

MULTI_RANK_CASES: dict = {}
"""case id -> (layout, case): every multi-rank case of this file, run per layout by `layout_results`."""


def multi_rank_case(case_id: str, layout: str, **case) -> str:
    MULTI_RANK_CASES[case_id] = (layout, dict(case, sp=LAYOUTS[layout]["sp"]))
    return case_id


_LAYOUT_RESULTS: dict = {}


def layout_results(layout: str, tmp_path_factory) -> dict:
    """Rank 0's result of every case of `layout` (case id -> dict), from one spawn of its ranks, made on first use
    and shared by the tests of that layout. Every case is registered at import (`multi_rank_case`), so the first
    test of a layout runs them all."""
    if layout not in _LAYOUT_RESULTS:
        out_dir = str(tmp_path_factory.mktemp(f"ranks-{layout}"))
        cases = {case_id: case for case_id, (where, case) in MULTI_RANK_CASES.items() if where == layout}
        world = LAYOUTS[layout]["world"]
        mp.start_processes(worker, args=(world, free_port(), cases, out_dir), nprocs=world, start_method="spawn",
                           join=True)
        _LAYOUT_RESULTS[layout] = {case_id: torch.load(os.path.join(out_dir, f"{case_id}.pt"))
                                   for case_id in cases}
    return _LAYOUT_RESULTS[layout]


@pytest.fixture
def on_ranks(tmp_path_factory):
    """(rank 0's result, one process's result) of a registered case; a case that raised on the ranks fails here."""
    def run(case_id: str) -> tuple[dict, dict]:
        layout, case = MULTI_RANK_CASES[case_id]
        got = layout_results(layout, tmp_path_factory)[case_id]
        assert "error" not in got, got.get("error")
        return got, reference(case)
    return run


def reference(case: dict) -> dict:
    torch.set_num_threads(1)
    critic = tiny_critic(case["heads"], case["kv_heads"]) if case.get("critic") else None
    model = case_model(case)
    published = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()
                 if is_adapter_key(name)} if case.get("lora") else None
    metrics, grads = run_step(model, ParallelState(), case, critic)
    return {"metrics": metrics, "grads": grads, "published": published}


def case_model(case: dict):
    """The case's policy: tiny_model, with LoRA adapters (their B random, so A's gradients are not zero) when the
    case asks for them; or the tiny vision-language model, its vision tower frozen when the case says so."""
    if case.get("vlm"):
        model = tiny_vlm()[0]
        if case.get("freeze"):
            model.model.visual.requires_grad_(False)
        return model
    model = tiny_model(case["heads"], case["kv_heads"], case.get("family"))
    if case.get("lora"):
        apply_lora(model, LoraSettings(rank=4, alpha=8.0))
        torch.manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(0.0, 0.1)
    return model


def assert_same_step(got: dict, expected: dict, tol: float = 1e-5) -> None:
    """The step's loss and every full gradient agree within `tol`."""
    assert abs(got["metrics"]["loss/pg"] - expected["metrics"]["loss/pg"]) < tol
    assert set(got["grads"]) == set(expected["grads"])
    for param, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][param], grad, atol=tol, rtol=0, msg=param)


MATCH_CASES = [multi_rank_case(f"match-{layout}-{'packed' if packing else 'padded'}", layout, seed=3, budget=40,
                               packing=packing, minibatches=minibatches, heads=4, kv_heads=2)
               for layout in LAYOUTS for packing, minibatches in ((False, 1), (True, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", MATCH_CASES)
def test_ranks_match_one_process(case_id, on_ranks):
    got, expected = on_ranks(case_id)
    for key in ("loss/pg", "loss/total", "policy/grad_norm", "policy/entropy", "offpolicy/mismatch_k3", "policy/ppo_kl"):
        assert abs(got["metrics"][key] - expected["metrics"][key]) < 1e-5, (key, got["metrics"][key],
                                                                            expected["metrics"][key])
    assert set(got["grads"]) == set(expected["grads"])
    for param, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][param], grad, atol=1e-5, rtol=0, msg=param)


ENTROPY_CASE = multi_rank_case("entropy-sp2", "sp2", seed=5, budget=40, packing=False, minibatches=1, heads=4,
                               kv_heads=2, entropy_coef=0.05)


@pytest.mark.slow
def test_the_entropy_bonus_on_ranks_matches_one_process(on_ranks):
    """algo.entropy_coef's gradient through the gathered sequence (Ulysses SP = 2; the head is FSDP2-sharded on
    both ranks). The data-parallel sum of the step's loss shares is the one test_ranks_match_one_process runs."""
    got, expected = on_ranks(ENTROPY_CASE)
    assert_same_step(got, expected)
    assert got["metrics"]["loss/entropy"] == pytest.approx(expected["metrics"]["loss/entropy"], abs=1e-5)
    assert expected["metrics"]["loss/entropy"] > 0


CRITIC_CASES = [multi_rank_case(f"critic-{layout}", layout, seed=9, budget=40, packing=packing, minibatches=2,
                                heads=4, kv_heads=2, critic=True)
                for layout, packing in (("fsdp2", False), ("sp2", True))]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", CRITIC_CASES)
def test_ppo_critic_on_ranks_matches_one_process(case_id, on_ranks):
    """PPO with GAE: the critic's values (split over ranks' rows, or over the SP group's columns, packed), its
    clipped value loss over 2 mini-batches and every gradient of both models within 1e-5 of one process."""
    got, expected = on_ranks(case_id)
    assert_same_step(got, expected)
    assert any(name.startswith("critic/") for name in expected["grads"])
    for key in ("critic/vf_loss", "critic/vpred/mean", "critic/vf_clipfrac", "critic/explained_var",
                "critic/values/mean", "critic/grad_norm"):
        assert got["metrics"][key] == pytest.approx(expected["metrics"][key], abs=1e-5), key
    assert expected["metrics"]["critic/vf_clipfrac"] > 0  # the second mini-batch's values moved past the clip


LORA_CASES = [multi_rank_case(f"lora-{layout}", layout, seed=13, budget=40, packing=packing, minibatches=2, heads=4,
                              kv_heads=2, lora=True)
              for layout, packing in (("fsdp2", False), ("sp2", True))]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", LORA_CASES)
def test_lora_on_ranks_matches_one_process(case_id, on_ranks):
    """LoRA RL (learner.lora) under FSDP2 and under Ulysses SP = 2: the loss and the adapters' gradients within
    1e-5 of one process, no gradient on any base weight, and the published version is the whole adapter alone."""
    got, expected = on_ranks(case_id)
    assert_same_step(got, expected)
    assert expected["grads"] and all(is_adapter_key(name) for name in expected["grads"])
    assert set(got["published"]) == set(expected["published"])
    for name, tensor in expected["published"].items():
        torch.testing.assert_close(got["published"][name], tensor, atol=0, rtol=0, msg=name)


FAMILY_CASES = [multi_rank_case(f"family-{family}-{layout}", layout, seed=7, budget=64, packing=True, minibatches=1,
                                heads=4, kv_heads=2, family=family)
                for family in FAMILIES if family != "qwen2" for layout in ("fsdp2", "sp2")]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", FAMILY_CASES)
def test_each_model_family_on_two_ranks_matches_one_process(case_id, on_ranks):
    """Qwen3, Llama 3, Mistral (sliding window 8, crossed by these sequences), Gemma 2 (soft-capping, alternating
    sliding layers, eager attention) and Qwen3-MoE, packed, under FSDP2 and under Ulysses SP = 2: the loss and every
    gradient within 1e-5 of one process."""
    assert_same_step(*on_ranks(case_id))


VLM_CASES = [multi_rank_case(f"vlm-{'frozen' if freeze else 'trained'}-{'packed' if packing else 'padded'}", "fsdp2",
                             seed=17, budget=64, packing=packing, minibatches=1, heads=2, kv_heads=2, vlm=True,
                             freeze=freeze)
             for freeze, packing in ((False, False), (True, True))]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", VLM_CASES)
def test_a_vision_language_model_on_two_ranks_matches_one_process(case_id, on_ranks):
    """Qwen2.5-VL under FSDP2 on 2 ranks, padded and packed: the loss and every gradient within 1e-5 of one
    process; with the tower frozen, no gradient reaches it. The text-only group's long rows fill micro-batches of
    their own, so some passes run the vision tower on one rank and skip it on the other."""
    got, expected = on_ranks(case_id)
    assert_same_step(got, expected)
    tower = [name for name in expected["grads"] if ".visual." in f".{name}"]
    assert not tower if MULTI_RANK_CASES[case_id][1]["freeze"] else tower


DEEPSPEED_CASES = [multi_rank_case(f"deepspeed-{family}", "sp2", seed=7, budget=64, packing=True, minibatches=1,
                                   heads=4, kv_heads=2, sp_impl="deepspeed",
                                   family=None if family == "qwen2" else family)
                   for family in ("qwen2", "gemma2")]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", DEEPSPEED_CASES)
def test_deepspeed_ulysses_matches_one_process(case_id, on_ranks):
    """learner.sp_impl=deepspeed: DeepSpeed's DistributedAttention does the all-to-alls on 2 gloo ranks, packed
    (Gemma 2: soft-capping and sliding windows reach the inner attention through it); the loss and every gradient
    within 1e-5 of one process."""
    assert_same_step(*on_ranks(case_id))


KV_REPEAT_CASE = multi_rank_case("kv-repeat-sp2", "sp2", seed=5, budget=64, packing=False, minibatches=1, heads=4,
                                 kv_heads=1)
SFT_CASE = multi_rank_case("sft-fsdp2xsp2", "fsdp2xsp2", seed=7, budget=24, packing=True, minibatches=1, heads=4,
                           kv_heads=2, sft=True)
AC_CASE = multi_rank_case("ac-fsdp2", "fsdp2", seed=11, budget=40, packing=False, minibatches=1, heads=4, kv_heads=2,
                          ac=True)
BF16_CASE = multi_rank_case("bf16-fsdp2", "fsdp2", seed=3, budget=40, packing=False, minibatches=1, heads=4,
                            kv_heads=2, param_dtype="bfloat16")


@pytest.mark.slow
def test_ulysses_repeats_kv_heads_when_sp_does_not_divide_them(on_ranks):
    assert check_heads(tiny_model(4, 1).config, 2) == 4
    assert_same_step(*on_ranks(KV_REPEAT_CASE))


@pytest.mark.slow
def test_sft_on_fsdp2_and_ulysses_matches_one_process(on_ranks):
    assert_same_step(*on_ranks(SFT_CASE))


@pytest.mark.slow
def test_activation_checkpointing_matches_and_published_weights_are_whole(on_ranks):
    got, expected = on_ranks(AC_CASE)
    assert_same_step(got, expected)
    full = tiny_model().state_dict()  # what rank 0 published before the step: every tensor whole, tied ones too
    assert set(got["published"]) == set(full)
    for name, tensor in full.items():
        assert torch.equal(got["published"][name], tensor), name


@pytest.mark.slow
def test_bf16_mixed_precision_trains_close_to_fp32(on_ranks):
    got, expected = on_ranks(BF16_CASE)
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
