"""Prefix reuse across the turns of an agent episode: turn k's prefill cost against turn 1's, with vLLM's prefix
caching on (generator.vllm.enable_prefix_caching, the default) and off (it reports; it does not assert).

An agent episode's turn k prompt is turn k-1's prompt + the model's reply + the environment's message, as token
ids appended to the ids the engine saw (asyncrl never re-tokenizes an episode). With prefix caching on, turn k
finds the KV blocks of everything before the new environment message in vLLM's cache and prefills only the rest;
off, it prefills the whole history again, so its cost grows with the turn.

Both engines are asyncrl's own (generator/engines/vllm_engine.py, built by factory.make_engine from the options
factory.engine_options reads off the generator section), started side by side in this process on the same model;
episodes run one at a time, the engines alternating (which one goes first alternates too) so that load from other
processes hits both alike. Each repetition draws a fresh first prompt and fresh environment messages (random token
ids, so turn 1 is always cold) and gives both engines the same ones; replies are greedy, so both see the same
history. Per turn it records:

- `cached`: prompt tokens vLLM found in its prefix cache (`Completion.cached_tokens`, vLLM's `num_cached_tokens`);
- `ttft_ms`: time to first token, from the call to `sample` until the engine's partial completion
  (`VllmEngine.in_flight`) holds a token, polled every `POLL_S`: the turn's prefill plus scheduling.

The table gives medians over the repetitions and each turn's TTFT over turn 1's. The model is a random-init Qwen2
(learner/init_model.py) of `--hidden` x `--layers` with the demo task's character tokenizer, large enough that
prefilling a few hundred tokens costs measurably more than decoding one on a CPU, or any model directory
(`--model`).
Usage:
    python -m asyncrl.bench.agent_prefix [--repeats N] [--first P] [--reply R] [--env E] [--hidden H] [--layers L]
        [--model DIR] [--threads T] [overrides...]
"""
import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

import numpy as np

TURNS = 4
POLL_S = 0.0005
"""How often the episode loop looks for the first token: finer than any prefill measured here, coarse enough not to
take a core from the engine."""
MODES = ("on", "off")


def build_model(out_dir: str, hidden: int, layers: int, max_positions: int, seed: int) -> str:
    """A random-init Qwen2 with the demo task's tokenizer (only token ids matter here; vLLM loads a tokenizer)."""
    from asyncrl.launch.demo import TASKS, train_char_tokenizer
    from asyncrl.learner.init_model import ModelShape, build_model as init_model, padded_vocab, save_model_dir

    task = TASKS["sort_digits"]
    tokenizer = train_char_tokenizer(task, task.tokenizer_corpus(seed))
    shape = ModelShape("qwen2", hidden, layers, max_positions=max_positions)
    model = init_model(shape, padded_vocab(len(tokenizer)), tokenizer.eos_token_id, tokenizer.pad_token_id, seed)
    save_model_dir(out_dir, model, tokenizer)
    return out_dir


def make_engines(modes: tuple, model_dir: str, max_model_len: int, kv_cache_gib: float, overrides: list) -> dict:
    """mode -> asyncrl's vLLM engine, built as a job builds its generator's, prefix caching on or off."""
    from asyncrl.configs import load_config
    from asyncrl.generator.engines.factory import engine_options, make_engine

    engines = {}
    for mode in modes:
        cfg = load_config(None, ["generator.engine=vllm", "generator.dtype=float32",
                                 f"generator.max_model_len={max_model_len}", f"generator.kv_cache_gib={kv_cache_gib}",
                                 f"generator.vllm.enable_prefix_caching={mode == 'on'}", *overrides])
        options = engine_options(cfg.generator, cfg.model, model_dir, seed=0)
        engines[mode] = make_engine("vllm", options)
    return engines


async def timed_sample(engine, prompt: list, sampling) -> tuple:
    """(completion, seconds to its first token, seconds to its end) of one request, alone on the engine."""
    task = asyncio.ensure_future(engine.sample(prompt, sampling, 1))
    started, first = time.perf_counter(), None
    while not task.done():
        if first is None and any(completion.token_ids for completion in list(engine.in_flight.values())):
            first = time.perf_counter()
        await asyncio.sleep(POLL_S)
    (completion,) = task.result()
    ended = time.perf_counter()
    return completion, (first or ended) - started, ended - started


async def episode(engine, first: list, env_messages: list, sampling) -> list:
    """One TURNS-turn episode: each turn's prompt is the last one + the reply + the next environment message."""
    prompt, turns = list(first), []
    for turn in range(TURNS):
        completion, ttft, total = await timed_sample(engine, prompt, sampling)
        turns.append({"prompt": len(prompt), "cached": completion.cached_tokens, "reply": len(completion.token_ids),
                      "ttft_ms": ttft * 1e3, "total_ms": total * 1e3, "reply_ids": list(completion.token_ids)})
        if turn + 1 < TURNS:
            prompt = prompt + list(completion.token_ids) + env_messages[turn]
    return turns


def draw(rng, vocab: int, first: int, env: int) -> tuple:
    """(turn 1's prompt, the environment's messages): random ids past the tokenizer's special ones."""
    return (rng.integers(3, vocab, first).tolist(),
            [rng.integers(3, vocab, env).tolist() for _ in range(TURNS - 1)])


async def run(engines: dict, vocab: int, args) -> dict:
    """mode -> [episode] over the repetitions (after one untimed warm-up episode each)."""
    from asyncrl.buffer.group import Sampling

    sampling = Sampling(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=args.reply)
    for engine in engines.values():
        await engine.start()
    modes = tuple(engines)
    try:
        for mode in modes:
            await episode(engines[mode], *draw(np.random.default_rng(10_000), vocab, args.first, args.env), sampling)
        runs = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            first, env_messages = draw(np.random.default_rng(repeat), vocab, args.first, args.env)
            for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                runs[mode].append(await episode(engines[mode], first, env_messages, sampling))
        return runs
    finally:
        for engine in engines.values():
            await engine.close()


def summarize(runs: dict) -> dict:
    """mode -> per turn: median prompt, cached, TTFT, and TTFT over turn 1's (medians over repetitions)."""
    table = {}
    for mode, episodes in runs.items():
        rows = []
        for turn in range(TURNS):
            row = {key: statistics.median(ep[turn][key] for ep in episodes)
                   for key in ("prompt", "cached", "ttft_ms", "total_ms")}
            rows.append({"turn": turn + 1, **row, "new": row["prompt"] - row["cached"]})
        for row in rows:
            row["ttft_vs_turn1"] = row["ttft_ms"] / rows[0]["ttft_ms"]
        table[mode] = rows
    return table


def same_replies(runs: dict) -> bool:
    """Both engines saw the same histories (greedy replies agreed), so the comparison is like for like (None: one
    mode ran)."""
    if set(runs) != set(MODES):
        return None
    return all(a[t]["reply_ids"] == b[t]["reply_ids"] for a, b in zip(runs["on"], runs["off"]) for t in range(TURNS))


def print_table(table: dict) -> None:
    print("| prefix caching | turn | prompt tokens | cached | prefilled | TTFT ms (median) | TTFT / turn 1 |")
    print("|---|---|---|---|---|---|---|")
    for mode, rows in table.items():
        for row in rows:
            print(f"| {mode} | {row['turn']} | {row['prompt']:.0f} | {row['cached']:.0f} | {row['new']:.0f} | "
                  f"{row['ttft_ms']:.1f} | {row['ttft_vs_turn1']:.2f} |")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="episodes per mode (medians over them)")
    parser.add_argument("--first", type=int, default=256, help="tokens of turn 1's prompt")
    parser.add_argument("--reply", type=int, default=32, help="max tokens of each reply (greedy)")
    parser.add_argument("--env", type=int, default=128, help="tokens of each environment message")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", help="a model directory instead of a random-init one")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="each engine's KV cache")
    parser.add_argument("--threads", type=int, default=0, help="torch threads here (0: torch's default)")
    parser.add_argument("--modes", default="on,off",
                        help="prefix caching on, off or both (one engine each; `on` alone skips the comparison)")
    parser.add_argument("overrides", nargs="*", help="config overrides for the generator section")
    args = parser.parse_args(argv)
    if min(args.repeats, args.first, args.reply, args.env) < 1:
        parser.error("--repeats, --first, --reply and --env must be >= 1")
    modes = tuple(mode for mode in MODES if mode in args.modes.split(","))
    if not modes or set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes must be a comma-separated subset of {MODES}, got {args.modes!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    max_model_len = args.first + (TURNS - 1) * args.env + TURNS * args.reply + 16
    with tempfile.TemporaryDirectory(prefix="agent-prefix-") as scratch:
        model_dir = args.model or build_model(scratch, args.hidden, args.layers, max_model_len, seed=0)
        with open(os.path.join(model_dir, "config.json")) as handle:
            vocab = json.load(handle)["vocab_size"]
        engines = make_engines(modes, model_dir, max_model_len, args.kv_cache_gib, args.overrides)
        runs = asyncio.run(run(engines, vocab, args))
    table = summarize(runs)
    print_table(table)
    last = TURNS - 1
    result = {"bench": "agent_prefix", "turns": TURNS, "repeats": args.repeats, "same_replies": same_replies(runs),
              "setting": {"first": args.first, "reply": args.reply, "env": args.env, "hidden": args.hidden,
                          "layers": args.layers, "model": args.model},
              "ttft_turn4_vs_turn1": {mode: table[mode][last]["ttft_vs_turn1"] for mode in modes},
              "ttft_turn4_on_vs_off": (table["on"][last]["ttft_ms"] / table["off"][last]["ttft_ms"]
                                       if len(modes) == 2 else None),
              "table": table}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
