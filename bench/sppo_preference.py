"""SPPO on a reward model's preferences, served by `asyncrl reward-server`, on the demo task. It reports; it does not
assert.

The paper's SPPO (arXiv 2405.00675) learns from preferences, not from a verifiable reward: each sample's target is its
win rate against the prompt's other samples under a preference model. asyncrl's path for it is a reward model served
to the generators (`reward.functions=[{name: rm, server: URL}]`), whose scores the learner reads as Bradley–Terry
preferences (`algo.sppo_target=bradley_terry`, algos/advantages.py::bradley_terry_win_rates). This bench runs that
path end to end on the demo task (digit sort) and measures it against the verifiable reward:

1. the reward model: a 2-layer Qwen2 sequence classifier (one label) on the demo's tokenizer, trained here by
   Bradley–Terry (-log σ(r_chosen - r_rejected)) on pairs from the demo's training prompts, as a reward model is
   trained on its policy's outputs: half are the warm-start policy's own samples (8 a prompt at T = 1 on the hf
   engine), a right one over a wrong one of the same prompt as the demo's reward judges them; half are the right
   answer over a corruption of it (two neighbours swapped, one digit changed, dropped or doubled, digits run on past
   the end). Each is rendered
   as the server renders it (generator/reward_server/classifier.py::render_conversation). Its pair accuracy on the
   held-out prompts' pairs of both kinds is reported: a reward model is a proxy, and the policy learns what it
   prefers;
2. `asyncrl reward-server` serves it on a free port of 127.0.0.1 (a subprocess, stopped by its PID at the end);
3. per seed (outermost), one after another: `asyncrl run` on the demo recipe with configs/sppo.yaml's algorithm (as
   docs/benchmarks.md "The recipes" measures SPPO): `sppo, verifiable` (the demo's 0/1 reward, sppo_target=softmean,
   the recipe as shipped) and `sppo, reward model` (the reward the server's score, sppo_target=bradley_terry);
4. the judge (bench/judge.py) scores each final model on the demo's held-out split with the verifiable reward, the
   same code for both runs (bench/time_to_reward.py::one_run).

Each run's sampled reward, first and last `--final-steps` steps, is in its own reward's units (0/1 against the
reward model's score); the judge's columns compare the two. Usage:
    python -m asyncrl.bench.sppo_preference [--seeds 0 1] [--steps 200] [--rm-steps 400] [--judge-prompts N]
        [--no-baseline] [--work-dir DIR] [overrides...]
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

SPPO = ["algo.loss=sppo", "algo.advantage=sppo", "algo.correction=bypass", "algo.loss_agg=seq-mean-token-mean",
        "algo.prox_logprobs=recompute"]
"""configs/sppo.yaml's algorithm on the demo recipe (the demo's A-3PO π_prox does not apply: SPPO's centre is μ)."""
VERIFIABLE, PREFERENCE = "sppo, verifiable", "sppo, reward model"


def corrupt(answer: str, rng: random.Random) -> str:
    """A wrong answer near the right one: two unequal neighbours swapped, one digit changed, dropped or doubled, or
    1-4 digits run on past the end (what a policy that learnt to please a reward model without ends would write)."""
    while True:
        kind, i = rng.randrange(5), rng.randrange(len(answer))
        if kind == 4:
            wrong = answer + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
            return wrong
        if kind == 0 and len(answer) > 1:
            j = rng.randrange(len(answer) - 1)
            wrong = answer[:j] + answer[j + 1] + answer[j] + answer[j + 2:]
        elif kind == 1:
            wrong = answer[:i] + rng.choice("0123456789") + answer[i + 1:]
        elif kind == 2 and len(answer) > 1:
            wrong = answer[:i] + answer[i + 1:]
        else:
            wrong = answer[:i] + answer[i] + answer[i:]
        if wrong != answer:
            return wrong


def preference_pairs(rows: list, sampled: list, tokenizer, count: int, rng: random.Random) -> tuple[list, list]:
    """`count` (chosen, rejected) texts, as the reward server renders them: half from the policy's own pairs
    (`sampled`, from policy_pairs), half the right answer of one of `rows` (verl-format demo rows) over a corruption
    of it."""
    from asyncrl.generator.reward_server.classifier import render_conversation
    from asyncrl.generator.reward_server.items import ScoreItem

    chosen, rejected = [], []
    for index in range(count):
        if sampled and index % 2 == 0:
            prompt, good, bad = rng.choice(sampled)
        else:
            row = rng.choice(rows)
            prompt, good = list(row["prompt"]), row["reward_model"]["ground_truth"]
            bad = corrupt(good, rng)
        chosen.append(render_conversation(tokenizer, ScoreItem(prompt, good)))
        rejected.append(render_conversation(tokenizer, ScoreItem(prompt, bad)))
    return chosen, rejected


def policy_pairs(policy_dir: str, rows: list, tokenizer, n: int, seed: int) -> list:
    """(prompt messages, right answer, wrong answer) from the warm-start policy's own samples: `n` a prompt at T = 1
    on the hf engine, judged by the demo's reward (exact match); one pair per prompt that has both."""
    from asyncrl.buffer.group import Sampling
    from asyncrl.generator.engines.base import EngineOptions
    from asyncrl.generator.engines.hf_engine import HfEngine
    from asyncrl.generator.tasks.exact_match import compute_score

    async def sample_all() -> list:
        engine = HfEngine(EngineOptions(policy_dir, "float32", max_model_len=128, kv_cache_gib=0.0, seed=seed))
        await engine.start()
        try:
            sampling = Sampling(temperature=1.0, max_tokens=10)  # the demo's rollout
            texts = [tokenizer.apply_chat_template(list(row["prompt"]), tokenize=False, add_generation_prompt=True)
                     for row in rows]  # rendered and tokenized as the generators do (data/prompts.py)
            return await asyncio.gather(*(engine.sample(tokenizer(text, add_special_tokens=False)["input_ids"],
                                                        sampling, n) for text in texts))
        finally:
            await engine.close()

    pairs, rng = [], random.Random(seed)
    for row, completions in zip(rows, asyncio.run(sample_all())):
        truth = row["reward_model"]["ground_truth"]
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True).strip() for c in completions]
        right = [t for t in texts if compute_score("", t, truth)["score"] == 1.0]
        wrong = [t for t in texts if compute_score("", t, truth)["score"] != 1.0]
        if right and wrong:
            pairs.append((list(row["prompt"]), rng.choice(right), rng.choice(wrong)))
    return pairs


def pair_scores(model, tokenizer, chosen: list, rejected: list):
    """The reward model's scores of the chosen and the rejected texts ([count] each), one padded batch."""
    encoded = tokenizer(chosen + rejected, padding=True, return_tensors="pt", add_special_tokens=False)
    scores = model(**encoded).logits[:, 0]
    return scores[:len(chosen)], scores[len(chosen):]


def train_reward_model(policy_dir: str, out_dir: str, train_rows: list, test_rows: list, steps: int,
                       batch_pairs: int, lr: float, seed: int, policy_prompts: int) -> dict:
    """Train and save the demo's reward model (see the module's docstring) on pairs from `policy_prompts` training
    prompts sampled by the policy and from corruptions; its held-out pair accuracy and margin."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.padding_side = "right"  # as the server pads (classifier.py): the score is read at the last real token
    started = time.monotonic()
    sampled = policy_pairs(policy_dir, train_rows[:policy_prompts], tokenizer, 8, seed)
    test_sampled = policy_pairs(policy_dir, test_rows, tokenizer, 8, seed + 1)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        good, bad = pair_scores(model, tokenizer, *preference_pairs(train_rows, sampled, tokenizer, batch_pairs, rng))
        loss = -torch.nn.functional.logsigmoid(good - bad).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"reward model: step {step + 1}/{steps}, loss {float(loss):.4f}", file=sys.stderr, flush=True)
    model.eval()
    scores = {"policy": None}  # None: no held-out prompt had both a right and a wrong sample
    with torch.no_grad():  # held-out pairs of each kind: the policy's own, and corruptions
        for kind, pool in (("policy", test_sampled), ("corrupted", [])):
            if kind == "policy" and not pool:
                continue
            good, bad = pair_scores(model, tokenizer, *preference_pairs(test_rows, pool, tokenizer,
                                                                        2 * max(len(pool), 128),
                                                                        random.Random(seed + 1)))
            keep = slice(0, None, 2) if pool else slice(None)  # the policy's pairs sit at even indices
            scores[kind] = float((good[keep] > bad[keep]).double().mean())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"rm_steps": steps, "rm_train_s": round(time.monotonic() - started, 1),
            "rm_policy_pairs": len(sampled), "rm_heldout_policy_pairs": len(test_sampled),
            "rm_heldout_pair_accuracy_policy": scores["policy"],
            "rm_heldout_pair_accuracy_corrupted": scores["corrupted"]}


def start_reward_server(model_dir: str, port: int, log_path: str, timeout_s: float = 120.0) -> subprocess.Popen:
    """`asyncrl reward-server` on 127.0.0.1:port, once /health answers (the generators' own wait for it)."""
    from asyncrl.generator.rewards.client import wait_for_server
    from asyncrl.generator.rewards.errors import RewardError

    log = open(log_path, "ab")
    server = subprocess.Popen([sys.executable, "-m", "asyncrl.launch.cli", "reward-server",
                               f"reward_server.model_path={model_dir}", f"reward_server.port={port}",
                               "reward_server.host=127.0.0.1", "reward_server.max_length=64"],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    log.close()
    try:
        asyncio.run(wait_for_server(f"http://127.0.0.1:{port}", timeout_s, say=lambda message: None))
    except RewardError as err:
        stop(server)
        raise RuntimeError(f"{err}; the server's log: {log_path}") from None
    return server


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def read_rows(path: str) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=200, help="RL steps of each run")
    parser.add_argument("--rm-steps", type=int, default=400, help="the reward model's training steps")
    parser.add_argument("--rm-batch", type=int, default=64, help="pairs per reward-model step")
    parser.add_argument("--rm-lr", type=float, default=1e-3)
    parser.add_argument("--rm-prompts", type=int, default=512, help="training prompts the policy samples for the "
                                                                     "reward model's own-sample pairs")
    parser.add_argument("--final-steps", type=int, default=20)
    parser.add_argument("--judge-n", type=int, default=8)
    parser.add_argument("--judge-ks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--judge-prompts", type=int, default=0, help="judge the first N held-out prompts (0: all)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="run SPPO on the reward model only (not also on the verifiable reward)")
    parser.add_argument("--work-dir", default=None, help="where the reward model and the runs go (a temp dir)")
    parser.add_argument("overrides", nargs="*", help="overrides for every run and the judge (the demo's, e.g. "
                                                     "demo.cache_dir=...)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from asyncrl.bench.buffer import free_port
    from asyncrl.bench.suite.task import demo_task
    from asyncrl.bench.time_to_reward import one_run
    from asyncrl.bench.time_to_reward import parse_args as ttr_args
    from asyncrl.bench.time_to_reward import set_up_task
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import heldout_file, prepare_demo

    workdir = args.work_dir or tempfile.mkdtemp(prefix="asyncrl-sppo-pref-")
    os.makedirs(workdir, exist_ok=True)
    cfg = load_config("demo_cpu.yaml", list(args.overrides))
    policy_dir, train_files = prepare_demo(cfg.demo, cfg.job.seed, say=lambda m: print(m, file=sys.stderr))
    rm_dir = os.path.join(workdir, "reward-model")
    rm = train_reward_model(policy_dir, rm_dir, read_rows(train_files[0]), read_rows(heldout_file(cfg.demo,
                            cfg.job.seed)), args.rm_steps, args.rm_batch, args.rm_lr, seed=0,
                            policy_prompts=args.rm_prompts)
    print(f"reward model: {json.dumps(rm)}", file=sys.stderr, flush=True)
    port = free_port()
    server = start_reward_server(rm_dir, port, os.path.join(workdir, "reward-server.log"))
    # time_to_reward's run and judge, so both runs are trained and judged exactly as the suite's
    ttr = ttr_args(["--configs", "--steps", str(args.steps), "--final-steps", str(args.final_steps), "--judge-n",
                    str(args.judge_n), "--judge-ks", *map(str, args.judge_ks), "--judge-prompts",
                    str(args.judge_prompts), *args.overrides])
    setup = set_up_task(demo_task(workdir, cfg.job.seed), ttr)
    plan = [(VERIFIABLE, SPPO)] if not args.no_baseline else []
    plan.append((PREFERENCE, [*SPPO, "algo.sppo_target=bradley_terry",
                              f"reward.functions=[{{name: rm, server: 'http://127.0.0.1:{port}'}}]"]))
    runs = {label: [] for label, _ in plan}
    try:
        for seed in args.seeds:
            for label, extra in plan:
                job_dir = os.path.join(workdir, f"seed{seed}-{'rm' if label == PREFERENCE else 'verifiable'}")
                run, _ = one_run(setup, label, extra, seed, job_dir, ttr)
                runs[label].append(run)
                print(f"{label} seed {seed}: {json.dumps(run)}", file=sys.stderr, flush=True)
    finally:
        stop(server)
    print_table(runs, args)
    result = {"bench": "sppo_preference", "seeds": args.seeds, "steps": args.steps, **rm, "runs": runs}
    print(json.dumps(result))
    return result


COLUMNS = [("reward_first", "sampled reward, first {f} steps"), ("reward_final", "last {f} steps"),
           ("heldout_greedy_reward", "held-out greedy (judge)"), ("heldout_pass_at_1", "T = 1 pass@1"),
           ("samples_per_s", "samples/s")]


def print_table(runs: dict, args) -> None:
    columns = [(key, title.format(f=args.final_steps)) for key, title in COLUMNS]
    print("| run | " + " | ".join(title for _, title in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for label, seeds in runs.items():
        cells = []
        for key, _ in columns:
            values = [run[key] for run in seeds if run.get(key) is not None]
            cells.append(f"{statistics.median(values):.3g}" if values else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
