"""Learner throughput, in one process on one synthetic batch (it reports; it does not assert).

1. `overhead`: tokens/s of asyncrl's `train_step` against a plain hand-written PyTorch step of the SAME math on the
   same model and batch: the demo recipe's algorithm (GRPO advantages, A-3PO's interpolated π_prox, the decoupled
   weight min(π_prox/μ, 5), PPO clip 0.2 / 0.28, token-mean), the same length-sorted micro-batches, gradient clipping
   and torch's default AdamW (`plain_step`; asyncrl's side has the learner's own optimizer). What asyncrl does beyond it: the LM head in checkpointed chunks, the entropy metric
   (from the same softmax), the loss's and the batch's metrics, NaN and padding guards. Issue 4's target is a ratio
   of at least 0.95. `--shape default`: Qwen2 of `--hidden`/`--layers`, 8 groups x 8 rows of 64 random tokens;
   `--shape demo`: the demo's warm-started model and a batch it sampled (bench/learner_profile.py), with the
   demo recipe's micro-batch budget.
2. `packing`: tokens/s of `train_step` with `learner.packing` on and off, on a batch with skewed lengths (most
   sequences short, a few long), where padding wastes most of the padded pass.
3. `precision`: tokens/s of `train_step` at `learner.autocast=bfloat16` against fp32 on the same model and batch,
   and the mean and largest |Δ logprob| between the two passes over the trained tokens.
4. `sp_memory`: activation memory of one rank for one long sequence at SP = 1 and SP = 2 (two gloo ranks running
   Ulysses; see bench/sp_memory.py for what is counted). Ideal ratio: 0.5.
Both sides of each speed comparison alternate, round by round, so machine noise hits them alike; each side's
tokens/s is over its median round, with the slowest and fastest rounds beside it. Usage:
    python -m asyncrl.bench.learner [--shape default|demo] [--parts overhead,packing,precision,sp_memory] [--rounds N]
        [--threads T] [--groups G] [--hidden H] [--layers L] [--seq-len S]
"""
import argparse
import dataclasses
import json
import socket
import statistics
import time

import numpy as np
import torch

from asyncrl.algos.config import AlgoConfig
from asyncrl.bench.sp_memory import measure_sp_memory
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.learner.batch import build_batch, split_microbatches
from asyncrl.learner.build import build_optimizer
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.precision import autocast_context, use_fp32_attention
from asyncrl.learner.train_step import StepSettings, compute_batch_logprobs, train_step

VOCAB = 512
PARTS = ("overhead", "packing", "sp_memory", "precision")
DEMO_ALGO = dict(advantage="grpo", loss="ppo", correction="decoupled", prox_logprobs="loglinear")
"""The demo recipe's algo section (configs/demo_cpu.yaml), which `plain_step` writes out by hand."""


def skewed_groups(num_groups: int, n: int, short: int, long: int, long_frac: float, seed: int,
                  stale_every: int = 0) -> list:
    """Groups whose completions are mostly `short` tokens, a `long_frac` fraction `long` tokens. With
    `stale_every` k, every k-th group was sampled one version before the others (version 0, the rest 1)."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(num_groups):
        version = 0 if stale_every and index % stale_every == 0 else int(bool(stale_every))
        samples = []
        for _ in range(n):
            length = long if rng.random() < long_frac else short
            samples.append(Sample(completion_ids=rng.integers(2, VOCAB, length).astype(np.int32),
                                  logprobs=-rng.random(length).astype(np.float32) * 2,
                                  versions=np.full(length, version, np.int32), reward=float(rng.integers(0, 2)),
                                  finish_reason="stop"))
        groups.append(Group(group_id=str(index), prompt_id="p", generator_id="bench",
                            prompt_ids=rng.integers(2, VOCAB, 8).astype(np.int32), samples=samples,
                            sampling=Sampling(temperature=1.0), created_at=0.0))
    return groups


def asyncrl_step(model, optimizer, scheduler, groups, settings: StepSettings, algo) -> None:
    train_step(model, optimizer, scheduler, groups, algo, settings)


def plain_advantages(groups: list, batch) -> torch.Tensor:
    """[B, 1] GRPO: (R - group mean) / (unbiased group std + 1e-6), in fp64 as asyncrl takes it, then fp32."""
    rewards = batch.token_rewards.sum(-1).double().view(len(groups), -1)
    centred = rewards - rewards.mean(-1, keepdim=True)
    return (centred / (rewards.std(-1, keepdim=True) + 1e-6)).float().reshape(-1, 1)


def plain_loss(model, micro, advantages: torch.Tensor, version: int, tokens: float,
               autocast: str = "") -> torch.Tensor:
    """One micro-batch's share of the demo recipe's loss, as a user would write it: full logits, log_softmax at
    the sampling temperature, A-3PO's π_prox (μ moved towards the current pass by α = (v - 1 - v_μ) / (v - v_μ),
    clamped to [0, 1]), the decoupled weight min(π_prox / μ, 5), PPO's clipped surrogate on π_θ / π_prox. With
    `autocast` the model's forward runs under it, as learner.autocast runs asyncrl's."""
    mask = micro.loss_mask  # [b, l]
    with autocast_context("cpu", autocast):
        logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1]  # [b, l, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / micro.temperatures[:, None, None]
    logprobs = logits.log_softmax(-1).gather(-1, micro.input_ids[:, 1:, None]).squeeze(-1)  # [b, l]
    behav = micro.logprobs_behav.to(logprobs.dtype)
    gap = (version - micro.versions).to(logprobs.dtype)
    alpha = torch.where((mask > 0) & (micro.versions >= 0) & (gap > 0), (gap - 1) / gap.clamp(min=1), 0.0)
    prox = behav + alpha.clamp(0, 1) * (logprobs.detach() - behav)
    weight = torch.exp(prox - behav).clamp(max=5.0)
    ratio = torch.exp(logprobs - prox)
    surrogate = torch.maximum(-ratio * advantages, -ratio.clamp(0.8, 1.28) * advantages)
    return (weight * surrogate * mask).sum() / tokens


def plain_step(model, optimizer, scheduler, groups, version: int, max_tokens: int, grad_clip: float = 1.0,
               autocast: str = "") -> float:
    """The demo recipe's step by hand, on asyncrl's length-sorted micro-batches, at asyncrl's precision (`autocast`:
    learner.autocast); returns the loss."""
    batch = build_batch(groups)
    advantages = plain_advantages(groups, batch)
    tokens = float(batch.loss_mask.sum())
    total = 0.0
    for micro in split_microbatches(batch, max_tokens):
        loss = plain_loss(model, micro, advantages[micro.rows], version, tokens, autocast)
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(steps: dict, rounds: int, tokens: int) -> dict:
    """Alternate the named step functions for `rounds` rounds (after one warm-up each): per name, tokens/s over
    its median round and over its slowest and fastest, and tokens per CPU-second of this process over its median
    round (`cpu_tokens_per_s`: on a machine shared with other jobs, wall time counts their load too; CPU time
    mostly does not)."""
    for step in steps.values():
        step()
    seconds = {name: [] for name in steps}
    cpu_seconds = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            step()
            seconds[name].append(time.perf_counter() - started)
            cpu_seconds[name].append(time.process_time() - cpu_started)
    return {name: {"tokens_per_s": tokens / statistics.median(times), "min": tokens / max(times),
                   "max": tokens / min(times), "cpu_tokens_per_s": tokens / statistics.median(cpu_seconds[name])}
            for name, times in seconds.items()}


def default_setup(args) -> tuple:
    """(model, optimizer, scheduler, groups, settings, algo) at the bench's own shape: random tokens, half the
    groups one version stale so A-3PO's π_prox moves."""
    model = build_qwen2(vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers, eos_token_id=1,
                        pad_token_id=0, seed=0).train()
    optimizer, scheduler = build_optimizer(model, LearnerConfig(lr=1e-6, warmup_steps=0))  # as the learner's
    groups = skewed_groups(args.groups, 8, short=64, long=64, long_frac=0.0, seed=1, stale_every=2)
    settings = StepSettings(version=1, max_staleness=1, max_tokens_per_microbatch=8192, chunk_tokens=4096,
                            grad_clip=1.0)
    return model, optimizer, scheduler, groups, settings, AlgoConfig(**DEMO_ALGO)


def demo_setup(args) -> tuple:
    """The same at the demo's shape: its model, a batch it sampled, its recipe's learner settings."""
    from asyncrl.bench.learner_profile import build_demo_step

    overrides = [f"learner.torch_threads={args.threads}"] if args.threads else []
    model, optimizer, scheduler, groups, algo, settings = build_demo_step("demo_cpu.yaml", overrides)
    for param_group in optimizer.param_groups:  # the weights (and the batch's ratios) stay where they were
        param_group["lr"] = 1e-9
    return model.train(), optimizer, scheduler, groups, settings, algo


def measure_overhead(args) -> dict:
    model, optimizer, scheduler, groups, settings, algo = (demo_setup if args.shape == "demo" else default_setup)(args)
    tokens = int(build_batch(groups).attention_mask.sum())
    plain_optimizer = torch.optim.AdamW(model.parameters(), lr=optimizer.param_groups[0]["lr"])  # torch's default
    plain_scheduler = torch.optim.lr_scheduler.LambdaLR(plain_optimizer, lambda step: 1.0)
    result = measure({
        "plain": lambda: plain_step(model, plain_optimizer, plain_scheduler, groups, settings.version,
                                    settings.max_tokens_per_microbatch, settings.grad_clip, settings.autocast),
        "asyncrl": lambda: asyncrl_step(model, optimizer, scheduler, groups, settings, algo)}, args.rounds, tokens)
    return {**result, "ratio": result["asyncrl"]["tokens_per_s"] / result["plain"]["tokens_per_s"],
            "cpu_ratio": result["asyncrl"]["cpu_tokens_per_s"] / result["plain"]["cpu_tokens_per_s"], "tokens": tokens, "rows": sum(len(group.samples) for group in groups)}


def measure_packing(args) -> dict:
    model = build_qwen2(vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers, eos_token_id=1,
                        pad_token_id=0, seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    skewed = skewed_groups(args.groups, 8, short=16, long=256, long_frac=0.1, seed=2)
    tokens = int(build_batch(skewed).attention_mask.sum())

    def step(packing: bool):
        settings = StepSettings(version=0, max_staleness=0, max_tokens_per_microbatch=8192, chunk_tokens=4096,
                                grad_clip=1.0, packing=packing)
        train_step(model, optimizer, scheduler, skewed, AlgoConfig(), settings)

    result = measure({"padded": lambda: step(False), "packed": lambda: step(True)}, args.rounds, tokens)
    return {**result, "speedup": result["packed"]["tokens_per_s"] / result["padded"]["tokens_per_s"]}


def measure_precision(args) -> dict:
    """train_step at learner.autocast "" (fp32) and "bfloat16", alternating on one model and batch (its lr is tiny,
    so the weights stay put), and how far the bf16 pass's logprobs are from the fp32 pass's: the mean and the
    largest |Δ logprob| over the batch's trained tokens (the noise autocast adds to every ratio π_θ / μ)."""
    model, optimizer, scheduler, groups, settings, algo = (demo_setup if args.shape == "demo" else default_setup)(args)
    use_fp32_attention(model)  # what the learner does on CPU under autocast; a no-op for fp32 inputs
    fp32, bf16 = (dataclasses.replace(settings, autocast=autocast) for autocast in ("", "bfloat16"))
    batch = build_batch(groups)
    tokens = int(batch.attention_mask.sum())
    mask = batch.loss_mask > 0
    gap = (compute_batch_logprobs(model, batch, bf16) - compute_batch_logprobs(model, batch, fp32)).abs()[mask]
    result = measure({"fp32": lambda: asyncrl_step(model, optimizer, scheduler, groups, fp32, algo),
                      "bf16": lambda: asyncrl_step(model, optimizer, scheduler, groups, bf16, algo)}, args.rounds,
                     tokens)
    return {**result, "speedup": result["bf16"]["tokens_per_s"] / result["fp32"]["tokens_per_s"],
            "logprob_abs_diff_mean": float(gap.mean()), "logprob_abs_diff_max": float(gap.max()), "tokens": tokens}


def print_speed(name: str, result: dict, first: str, second: str, ratio: float, note: str) -> None:
    def cell(side):
        return f"{result[side]['tokens_per_s']:.0f} [{result[side]['min']:.0f}, {result[side]['max']:.0f}]"

    print(f"{name:<10} {cell(first):>22} {cell(second):>22} {ratio:>8.3f}   ({note})")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("default", "demo"), default="default",
                        help="overhead's model and batch: the bench's own, or the demo's")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default "
                        "(the demo's learner.torch_threads with --shape demo)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the long sequence of sp_memory")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts takes {PARTS}, not {sorted(unknown)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"bench": "learner", "shape": args.shape, "rounds": args.rounds, "hidden": args.hidden,
              "layers": args.layers}
    print(f"{'benchmark':<10} {'baseline tok/s':>22} {'asyncrl tok/s':>22} {'ratio':>8}")
    if "overhead" in parts:
        overhead = result["overhead"] = measure_overhead(args)
        result["threads"] = torch.get_num_threads()
        print_speed("overhead", overhead, "plain", "asyncrl", overhead["ratio"],
                    f"plain loop of the same math / train_step, {args.shape} shape, {overhead['rows']} rows, "
                    f"{overhead['tokens']} tokens, {torch.get_num_threads()} threads; per CPU-second: "
                    f"{overhead['cpu_ratio']:.3f}")
    if "packing" in parts:
        packing = result["packing"] = measure_packing(args)
        print_speed("packing", packing, "padded", "packed", packing["speedup"],
                    "padded / packed, 90% 16-token and 10% 256-token completions")
    if "precision" in parts:
        precision = result["precision"] = measure_precision(args)
        print_speed("precision", precision, "fp32", "bf16", precision["speedup"],
                    f"train_step at learner.autocast=bfloat16 / fp32, {args.shape} shape; |Δ logprob| mean "
                    f"{precision['logprob_abs_diff_mean']:.2g}, max {precision['logprob_abs_diff_max']:.2g}")
    if "sp_memory" in parts:
        memory = measure_sp_memory(args.seq_len, args.hidden, args.layers, free_port)
        result["sp_memory"] = {"seq_len": args.seq_len, "sp1": memory[1], "sp2": memory[2],
                               "activation_ratio": memory[2]["activation_bytes"] / memory[1]["activation_bytes"]}
        print_memory(memory, result["sp_memory"]["activation_ratio"], args.seq_len)
    print(json.dumps(result))
    return result


def print_memory(memory: dict, ratio: float, seq_len: int) -> None:
    print(f"{'benchmark':<10} {'SP=1 MiB':>22} {'SP=2 MiB':>22} {'ratio':>8}")
    print(f"{'sp_memory':<10} {memory[1]['activation_bytes'] / 2**20:>22.1f} "
          f"{memory[2]['activation_bytes'] / 2**20:>22.1f} {ratio:>8.3f}   (saved activations of rank 0, one "
          f"{seq_len}-token sequence)")
    print(f"{'':<10} {memory[1]['peak_rss_bytes'] / 2**20:>22.1f} {memory[2]['peak_rss_bytes'] / 2**20:>22.1f} "
          f"{memory[2]['peak_rss_bytes'] / memory[1]['peak_rss_bytes']:>8.3f}   (peak RSS of rank 0: model, torch "
          f"and interpreter included)")


if __name__ == "__main__":
    main()
