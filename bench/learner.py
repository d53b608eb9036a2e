"""Learner throughput, in one process on one synthetic batch (it reports; it does not assert).

1. `overhead`: tokens/s of asyncrl's `train_step` (decoupled PPO, chunked tempered logprobs, metrics) against a
   plain hand-written PyTorch step on the same model and data (forward, log_softmax, REINFORCE loss, AdamW).
   Issue 4's target is a ratio of at least 0.95.
2. `packing`: tokens/s of `train_step` with `learner.packing` on and off, on a batch with skewed lengths (most
   sequences short, a few long), where padding wastes most of the padded pass.
3. `sp_memory`: activation memory of one rank for one long sequence at SP = 1 and SP = 2 (two gloo ranks running
   Ulysses; see bench/sp_memory.py for what is counted). Ideal ratio: 0.5.
Both sides of each speed comparison alternate, round by round, so machine noise hits them alike. Usage:
    python -m asyncrl.bench.learner [--rounds N] [--groups G] [--hidden H] [--layers L] [--seq-len S]
"""
import argparse
import json
import socket
import time

import numpy as np
import torch

from asyncrl.algos.config import AlgoConfig
from asyncrl.bench.sp_memory import measure_sp_memory
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.learner.batch import build_batch
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.train_step import StepSettings, train_step

VOCAB = 512


def skewed_groups(num_groups: int, n: int, short: int, long: int, long_frac: float, seed: int) -> list:
    """Groups whose completions are mostly `short` tokens, a `long_frac` fraction `long` tokens."""
    rng = np.random.default_rng(seed)
    groups = []
    for index in range(num_groups):
        samples = []
        for _ in range(n):
            length = long if rng.random() < long_frac else short
            samples.append(Sample(completion_ids=rng.integers(2, VOCAB, length).astype(np.int32),
                                  logprobs=-rng.random(length).astype(np.float32) * 2,
                                  versions=np.zeros(length, np.int32), reward=float(rng.integers(0, 2)),
                                  finish_reason="stop"))
        groups.append(Group(group_id=str(index), prompt_id="p", generator_id="bench",
                            prompt_ids=rng.integers(2, VOCAB, 8).astype(np.int32), samples=samples,
                            sampling=Sampling(temperature=1.0), created_at=0.0))
    return groups


def asyncrl_step(model, optimizer, groups, packing: bool, max_tokens: int) -> None:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    settings = StepSettings(version=0, max_staleness=0, max_tokens_per_microbatch=max_tokens, chunk_tokens=4096,
                            grad_clip=1.0, packing=packing)
    train_step(model, optimizer, scheduler, groups, AlgoConfig(), settings)


def plain_step(model, optimizer, groups, max_tokens: int) -> None:
    """What a user would write by hand: padded forward, full log_softmax, REINFORCE with group-mean baseline."""
    batch = build_batch(groups)
    rewards = batch.token_rewards.sum(-1).view(len(groups), -1)
    advantages = (rewards - rewards.mean(-1, keepdim=True)).reshape(-1, 1)
    rows_per_micro = max(1, max_tokens // batch.input_ids.shape[1])
    tokens = batch.loss_mask.sum()
    for start in range(0, batch.num_rows, rows_per_micro):
        rows = slice(start, start + rows_per_micro)
        logits = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits[:, :-1]
        logprobs = logits.float().log_softmax(-1).gather(-1, batch.input_ids[rows, 1:, None]).squeeze(-1)
        loss = -(advantages[rows] * logprobs * batch.loss_mask[rows]).sum() / tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(steps: dict, rounds: int, tokens: int) -> dict:
    """Alternate the named step functions for `rounds` rounds (after one warm-up each); tokens/s per name."""
    for step in steps.values():
        step()
    elapsed = {name: 0.0 for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            elapsed[name] += time.perf_counter() - started
    return {name: tokens * rounds / seconds for name, seconds in elapsed.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the long sequence of sp_memory")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_qwen2(vocab_size=VOCAB, hidden_size=args.hidden, num_layers=args.layers, eos_token_id=1,
                        pad_token_id=0, seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    max_tokens = 8192
    uniform = skewed_groups(args.groups, 8, short=64, long=64, long_frac=0.0, seed=1)
    skewed = skewed_groups(args.groups, 8, short=16, long=256, long_frac=0.1, seed=2)
    uniform_tokens = int(build_batch(uniform).attention_mask.sum())
    skewed_tokens = int(build_batch(skewed).attention_mask.sum())
    overhead = measure({"plain": lambda: plain_step(model, optimizer, uniform, max_tokens),
                        "asyncrl": lambda: asyncrl_step(model, optimizer, uniform, False, max_tokens)},
                       args.rounds, uniform_tokens)
    packing = measure({"padded": lambda: asyncrl_step(model, optimizer, skewed, False, max_tokens),
                       "packed": lambda: asyncrl_step(model, optimizer, skewed, True, max_tokens)},
                      args.rounds, skewed_tokens)
    memory = measure_sp_memory(args.seq_len, args.hidden, args.layers, free_port)
    result = {"bench": "learner", "rounds": args.rounds, "hidden": args.hidden, "layers": args.layers,
              "overhead": {**overhead, "ratio": overhead["asyncrl"] / overhead["plain"]},
              "packing": {**packing, "speedup": packing["packed"] / packing["padded"]},
              "sp_memory": {"seq_len": args.seq_len, "sp1": memory[1], "sp2": memory[2],
                            "activation_ratio": memory[2]["activation_bytes"] / memory[1]["activation_bytes"]}}
    print(f"{'benchmark':<10} {'baseline tok/s':>15} {'asyncrl tok/s':>15} {'ratio':>8}")
    print(f"{'overhead':<10} {overhead['plain']:>15.0f} {overhead['asyncrl']:>15.0f} "
          f"{result['overhead']['ratio']:>8.3f}   (plain loop / train_step, uniform 64-token completions)")
    print(f"{'packing':<10} {packing['padded']:>15.0f} {packing['packed']:>15.0f} "
          f"{result['packing']['speedup']:>8.3f}   (padded / packed, 90% 16-token and 10% 256-token completions)")
    print(f"{'benchmark':<10} {'SP=1 MiB':>15} {'SP=2 MiB':>15} {'ratio':>8}")
    print(f"{'sp_memory':<10} {memory[1]['activation_bytes'] / 2**20:>15.1f} {memory[2]['activation_bytes'] / 2**20:>15.1f} "
          f"{result['sp_memory']['activation_ratio']:>8.3f}   (saved activations of rank 0, one {args.seq_len}-token "
          f"sequence)")
    print(f"{'':<10} {memory[1]['peak_rss_bytes'] / 2**20:>15.1f} {memory[2]['peak_rss_bytes'] / 2**20:>15.1f} "
          f"{memory[2]['peak_rss_bytes'] / memory[1]['peak_rss_bytes']:>8.3f}   (peak RSS of rank 0: model, torch "
          f"and interpreter included)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
