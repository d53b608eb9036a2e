"""Generator tokens/s on the demo's batch: asyncrl's engines against raw vLLM and raw HF `generate` (it reports; it
does not assert).

The batch is one step's worth of the recipe: `buffer.groups_per_step` prompts from the demo's dataset × `rollout.n`
samples, at most `rollout.max_tokens` new tokens, the recipe's temperature. Each contender runs in its own process
(so thread pools and vLLM's engine-core process never overlap), warms up, then decodes the batch `--rounds` times;
tokens/s is completion tokens over wall time. That is one repeat: `--repeats` runs every contender again, in a
rotated order each time (contenders interleaved, so a machine that slows down mid-run slows them all alike), and the
table reports each contender's median tokens/s with its range over the repeats, and the ratio to the faster raw
path computed within each repeat (median and range): one number from one run each moved by 30% between two runs
on an idle 2-core machine.

- `hf_generate`: transformers' `model.generate` on the whole batch at once (left-padded, `num_return_sequences=n`).
- `vllm_generate`: vLLM's offline `LLM.generate` with `SamplingParams(n=...)` on all prompts at once.
- `asyncrl_hf`, `asyncrl_vllm`: asyncrl's engines as the rollout loop drives them, one concurrent `sample` call per
  group. The target is at least 0.95 of the faster raw path (`ratio` in the JSON line). After their timed
  rounds they also time what the rollout loop does with a batch besides sampling it (`group work s`: decode, the
  job's reward in its worker processes, building and encoding each group; `time_group_work`), to compare with the
  batch's sampling time.
Usage:
    python -m asyncrl.bench.generator_speed [--rounds N] [--repeats R] [--threads T] [--contenders A,B,...] [overrides...]
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

CONTENDERS = ("hf_generate", "vllm_generate", "asyncrl_hf", "asyncrl_vllm")
RAW_OF = {"asyncrl_hf": "hf_generate", "asyncrl_vllm": "vllm_generate"}
"""Each asyncrl engine's library driven raw: the issue's bar is asyncrl-vLLM at 0.95x raw vLLM `generate`."""


def demo_batch(overrides: list) -> tuple:
    """(cfg, model dir, [PromptRow] of one step's groups), from the demo's cached assets."""
    from transformers import AutoTokenizer

    from asyncrl.configs import load_config
    from asyncrl.data.prompts import read_rows, tokenize_rows
    from asyncrl.launch.job import resolve_rl_inputs

    cfg = load_config("demo_cpu.yaml", overrides)
    model_dir, files = resolve_rl_inputs(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows, _ = tokenize_rows(read_rows(files), tokenizer, cfg.data.max_prompt_tokens)
    return cfg, model_dir, rows[:cfg.buffer.groups_per_step]


WARMUP_ROUNDS = 3
"""Untimed rounds first: oneDNN and vLLM settle in over the first few batches."""


def rate(tokens: int, seconds: float, rounds: int) -> dict:
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "batch_s": seconds / rounds}


def time_rounds(run_once, rounds: int) -> dict:
    """Warm up, then time `rounds` calls of `run_once() -> completion tokens`."""
    for _ in range(WARMUP_ROUNDS):
        run_once()
    tokens, started = 0, time.perf_counter()
    for _ in range(rounds):
        tokens += run_once()
    return rate(tokens, time.perf_counter() - started, rounds)


def bench_hf_generate(cfg, model_dir: str, prompts: list, rounds: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.generator.engines.hf_engine import left_pad

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids, attention_mask = left_pad(prompts)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)

    def run_once() -> int:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                 temperature=cfg.rollout.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=cfg.rollout.max_tokens, num_return_sequences=cfg.rollout.n,
                                 pad_token_id=pad)
        new = out[:, input_ids.shape[1]:]
        ended = torch.isin(new, torch.tensor(eos if isinstance(eos, list) else [eos]))
        # tokens up to and including the first EOS; after it generate only pads
        lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, torch.full_like(ended[:, 0], new.shape[1],
                                                                                       dtype=torch.long))
        return int(lengths.sum())

    return time_rounds(run_once, rounds)


def bench_vllm_generate(cfg, model_dir: str, prompts: list, rounds: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", max_model_len=cfg.generator.max_model_len, enforce_eager=True,
              kv_cache_memory_bytes=int(cfg.generator.kv_cache_gib * (1 << 30)), seed=0, disable_log_stats=True)
    params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens,
                            logprobs=0)
    batch = [{"prompt_token_ids": prompt} for prompt in prompts]

    def run_once() -> int:
        outputs = llm.generate(batch, params, use_tqdm=False)
        return sum(len(completion.token_ids) for output in outputs for completion in output.outputs)

    return time_rounds(run_once, rounds)


def bench_asyncrl_engine(engine_name: str, cfg, model_dir: str, rows: list, rounds: int) -> dict:
    from asyncrl.buffer.group import Sampling
    from asyncrl.generator.engines.base import EngineOptions
    from asyncrl.generator.engines.factory import make_engine

    sampling = Sampling(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.max_tokens)
    engine = make_engine(engine_name, EngineOptions(model_dir, "float32", max_model_len=cfg.generator.max_model_len,
                                                    kv_cache_gib=cfg.generator.kv_cache_gib, seed=0))

    async def main() -> dict:
        await engine.start()
        try:
            for round_index in range(WARMUP_ROUNDS + rounds):
                if round_index == WARMUP_ROUNDS:
                    tokens, started = 0, time.perf_counter()
                groups = await asyncio.gather(*(engine.sample(row.prompt_ids, sampling, cfg.rollout.n)
                                                for row in rows))
                if round_index >= WARMUP_ROUNDS:
                    tokens += sum(len(completion.token_ids) for group in groups for completion in group)
            result = rate(tokens, time.perf_counter() - started, rounds)
        finally:
            await engine.close()
        return {**result, "group_work_s": await time_group_work(cfg, model_dir, rows, groups)}

    return asyncio.run(main())


async def time_group_work(cfg, model_dir: str, rows: list, groups: list, rounds: int = 5) -> float:
    """Median seconds, per batch, of what the rollout loop does with a step's groups besides sampling them
    (generator/sampling.py, generator/rollout.py::_send): decode and score every completion with the job's reward
    (its worker processes), build each Group, encode it for the buffer; all groups at once, as the rollout's
    workers do, on the completions the engine sampled last, handed back by an engine that does nothing."""
    from transformers import AutoTokenizer

    from asyncrl.buffer.codec import encode_group
    from asyncrl.generator.rewards.scorer import RewardScorer
    from asyncrl.generator.rollout import RolloutStats
    from asyncrl.generator.sampling import GroupSampler

    sampled = {tuple(row.prompt_ids): group for row, group in zip(rows, groups)}

    class Replay:
        async def sample(self, prompt_ids: list, sampling, n: int) -> list:
            return sampled[tuple(prompt_ids)]

    reward = cfg.reward
    scorer = RewardScorer(reward.path, reward.function, cfg.generator.reward_workers, reward.timeout_s,
                          functions=reward.functions)
    await scorer.start()
    try:
        sampler = GroupSampler(Replay(), scorer, AutoTokenizer.from_pretrained(model_dir),
                               cfg.rollout, "bench", RolloutStats(), reward_shaping=reward)

        async def one(row) -> bytes:
            return encode_group(await sampler.sample(row))

        seconds = []
        for _ in range(WARMUP_ROUNDS + rounds):
            started = time.perf_counter()
            await asyncio.gather(*(one(row) for row in rows))
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds[WARMUP_ROUNDS:])
    finally:
        await scorer.close()


def run_contender(name: str, rounds: int, threads: int, overrides: list) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    cfg, model_dir, rows = demo_batch(overrides)
    prompts = [row.prompt_ids for row in rows]
    if name == "hf_generate":
        return bench_hf_generate(cfg, model_dir, prompts, rounds)
    if name == "vllm_generate":
        return bench_vllm_generate(cfg, model_dir, prompts, rounds)
    return bench_asyncrl_engine(name.split("_", 1)[1], cfg, model_dir, rows, rounds)


def in_subprocess(name: str, rounds: int, threads: int, overrides: list) -> dict:
    command = [sys.executable, "-m", "asyncrl.bench.generator_speed", "--only", name, "--rounds", str(rounds),
               "--threads", str(threads), *overrides]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]  # vLLM logs to stdout too
    return json.loads(lines[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="timed batches per contender and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="times every contender runs, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each contender (0: torch's default)")
    parser.add_argument("--only", choices=CONTENDERS, help="run one contender here and print its JSON (internal)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="comma-separated subset to run (at least one raw path and one asyncrl engine)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.only:
        result = run_contender(args.only, args.rounds, args.threads, args.overrides)
        print(json.dumps(result))
        return result
    chosen = [name for name in CONTENDERS if name in args.contenders.split(",")]
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    raw = [name for name in chosen if not name.startswith("asyncrl_")]
    engines = [name for name in chosen if name.startswith("asyncrl_")]
    if unknown or not raw or not engines:
        parser.error(f"--contenders must name at least one raw path and one asyncrl engine of {CONTENDERS}"
                     f"{f' (unknown: {sorted(unknown)})' if unknown else ''}")
    repeats = [{} for _ in range(args.repeats)]
    for index, repeat in enumerate(repeats):
        order = chosen[index % len(chosen):] + chosen[:index % len(chosen)]
        for name in order:
            repeat[name] = in_subprocess(name, args.rounds, args.threads, args.overrides)
    rate_of = {name: [repeat[name]["tokens_per_s"] for repeat in repeats] for name in chosen}
    faster_raw = max(raw, key=lambda name: statistics.median(rate_of[name]))
    best = max(engines, key=lambda name: statistics.median(rate_of[name]))
    rows = {}
    for name in chosen:  # the ratio within each repeat, against the same repeat's raw path
        ratios = [repeat[name]["tokens_per_s"] / repeat[faster_raw]["tokens_per_s"] for repeat in repeats]
        rows[name] = {"tokens": repeats[0][name]["tokens"], "tokens_per_s": statistics.median(rate_of[name]),
                      "tokens_per_s_range": [min(rate_of[name]), max(rate_of[name])],
                      "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                      "batch_s": statistics.median(repeat[name]["batch_s"] for repeat in repeats)}
        own_raw = RAW_OF.get(name)
        if own_raw in chosen:  # asyncrl's engine against the same library driven raw, paired within each repeat
            own = [repeat[name]["tokens_per_s"] / repeat[own_raw]["tokens_per_s"] for repeat in repeats]
            rows[name]["vs_own_raw"] = statistics.median(own)
            rows[name]["vs_own_raw_range"] = [min(own), max(own)]
        if "group_work_s" in repeats[0][name]:  # asyncrl's engines: the rollout's own work on the batch
            rows[name]["group_work_s"] = statistics.median(repeat[name]["group_work_s"] for repeat in repeats)
    print(f"{args.repeats} repeats of {args.rounds} rounds each, contenders interleaved; median (min-max)")
    print(f"{'contender':<16}{'tokens/s':>22}{'batch s':>10}{'vs ' + faster_raw:>26}{'vs its raw library':>26}"
          f"{'group work s':>14}")
    for name, row in rows.items():
        low, high = row["tokens_per_s_range"]
        ratio_low, ratio_high = row["ratio_range"]
        rate = f"{row['tokens_per_s']:.0f} ({low:.0f}-{high:.0f})"
        own = (f"{row['vs_own_raw']:.2f} ({row['vs_own_raw_range'][0]:.2f}-{row['vs_own_raw_range'][1]:.2f})"
               if "vs_own_raw" in row else "")
        work = f"{row['group_work_s']:.3f}" if "group_work_s" in row else ""
        print(f"{name:<16}{rate:>22}{row['batch_s']:>10.3f}{row['ratio']:>14.2f} ({ratio_low:.2f}-{ratio_high:.2f})"
              f"{own:>26}{work:>14}")
    result = {"bench": "generator_speed", "repeats": args.repeats, "rounds": args.rounds, "faster_raw": faster_raw,
              "best_engine": best, "ratio": rows[best]["ratio"], "ratio_range": rows[best]["ratio_range"],
              "rows": rows}
    print(json.dumps(result))
    return result

if __name__ == "__main__":
    main()
