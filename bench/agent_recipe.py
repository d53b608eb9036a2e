"""The agent recipe's reward on held-out episodes, before and after RL, over seeds. It reports; it does not assert.

For every seed, one after another: the demo's assets are built (the SFT warm start, timed on its own: a cached warm
start costs nothing), then `asyncrl run --config agent_cpu.yaml job.seed=S` trains, timed. Then the agent itself
(agent.path, unchanged) plays the demo's held-out prompts (launch/demo.py::heldout_file, none of them trained on)
through the generator's own OpenAI-compatible endpoint on the recipe's engine, at the recipe's temperature (the policy
as trained), once on the SFT model and once on the job's last checkpoint (exported): the path of `asyncrl eval` with
the recipe (launch/evaluate.py), which plays episodes for a job with an agent. An episode's reward is what the agent
returned; "tool use" is the fraction of episodes with at least one well-formed call. Evaluation rounds during training
sample single turns (configs/run_config.py::training_eval_blocker turns them off for an agent job), so the held-out
reward is measured here, after it. Also from the job's progress log: the mean reward of everything sampled, first and
last 10% of the steps.

The table shows each seed and the median; the last line is JSON with every run. Usage:
    python -m asyncrl.bench.agent_recipe [--seeds 0 1 2] [--episodes 2] [--warm-start-seed K]
        [--config agent_cpu.yaml] [--work-dir DIR] [overrides...]
(run it from the repository root: the recipe's agent.path is relative to it).
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def progress_rewards(job_dir: str) -> list:
    """Per step, the mean reward of everything the policy sampled (bench/time_to_reward.py::row_reward: dynamic
    sampling drops all-0 and all-1 groups from what the learner trains on, not from this)."""
    from asyncrl.bench.time_to_reward import row_reward

    with open(os.path.join(job_dir, "progress.jsonl")) as handle:
        return [row_reward(json.loads(line)) for line in handle if line.strip()]


def first_last(values: list, frac: float = 0.1) -> tuple:
    """Mean of the first and of the last `frac` of `values` (at least one each); (None, None) when empty."""
    if not values:
        return None, None
    k = max(1, int(len(values) * frac))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def play_heldout(cfg, model_dir: str, heldout: str, episodes_per_prompt: int, seed: int) -> dict:
    """The agent's episodes on the held-out file against `model_dir`, played and scored by `asyncrl eval`'s own
    path (launch/evaluate.py: the generator's episode runner and endpoint, each episode scored as training does) at
    the recipe's temperature: mean reward, the share of episodes with a tool call, env errors."""
    from dataclasses import replace

    from asyncrl.launch.evaluate import run_eval

    cfg = replace(cfg, job=replace(cfg.job, seed=seed),
                  eval=replace(cfg.eval, files=[heldout], n=episodes_per_prompt, k_values=[1],
                               temperature=cfg.rollout.temperature))
    metrics = asyncio.run(run_eval(cfg, model_dir, say=lambda message: None))
    return {"reward": metrics["eval/all/mean_reward"], "tool_use": metrics["eval/all/tool_use"],
            "episodes": int(metrics["eval/all/prompts"]) * episodes_per_prompt,
            "env_errors": int(sum(value for key, value in metrics.items() if key.startswith("eval/env_errors/")))}


def run_seed(recipe: str, overrides: list, seed: int, work: str, episodes_per_prompt: int,
             warm_start_seed: int | None) -> dict:
    """One seed: build (or find) the warm start, train, export, play the held-out prompts on both models. With
    `warm_start_seed`, every seed starts from that seed's warm start and prompts (model.path, data.train_files):
    the seed then moves RL only, as in bench/time_to_reward.py."""
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import demo_paths, heldout_file, prepare_demo
    from asyncrl.learner.export import export_checkpoint

    asset_seed = seed if warm_start_seed is None else warm_start_seed
    cfg = load_config(recipe, [*overrides, f"job.seed={asset_seed}"])
    started = time.monotonic()
    cached = os.path.isfile(os.path.join(demo_paths(cfg.demo, asset_seed)[0], "DONE"))
    sft_dir, train_files = prepare_demo(cfg.demo, asset_seed, say=lambda message: None)
    sft_s = time.monotonic() - started
    heldout = heldout_file(cfg.demo, asset_seed)
    overrides = [*overrides, f"job.seed={seed}"]
    if warm_start_seed is not None:
        overrides += [f"model.path={sft_dir}", f"data.train_files=[{train_files[0]}]"]
    job_dir = os.path.join(work, f"job-{seed}")
    env = {**os.environ, "ASYNCRL_JOB_DIR": job_dir, "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{work}/mlflow.db")}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", "--config", recipe, *overrides],
                         env=env, capture_output=True, text=True)
    rl_s = time.monotonic() - started
    if out.returncode != 0:
        raise SystemExit(f"seed {seed}: asyncrl run exited {out.returncode}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    rl_dir = export_checkpoint(os.path.join(job_dir, "checkpoints"), os.path.join(work, f"rl-{seed}"))
    before = play_heldout(cfg, sft_dir, heldout, episodes_per_prompt, seed)
    after = play_heldout(cfg, rl_dir, heldout, episodes_per_prompt, seed)
    first, last = first_last(progress_rewards(job_dir))
    return {"seed": seed, "warm_start_seed": asset_seed, "sft_s": round(sft_s, 1), "sft_cached": cached,
            "rl_s": round(rl_s, 1), "sampled_reward_first": first, "sampled_reward_last": last,
            "heldout_sft": before, "heldout_rl": after}


def fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(runs: list) -> str:
    lines = ["| seed | SFT warm start | RL job | sampled reward first → last 10% | held out: reward SFT → RL "
             "| held out: tool use SFT → RL |", "|---|---|---|---|---|---|"]
    for run in runs:
        sft = "cached" if run["sft_cached"] else f"{run['sft_s']:.0f} s"
        lines.append(f"| {run['seed']} | {sft} | {run['rl_s']:.0f} s | {fmt(run['sampled_reward_first'])} → "
                     f"{fmt(run['sampled_reward_last'])} | {fmt(run['heldout_sft']['reward'])} → "
                     f"{fmt(run['heldout_rl']['reward'])} | {fmt(run['heldout_sft']['tool_use'])} → "
                     f"{fmt(run['heldout_rl']['tool_use'])} |")
    median = [statistics.median(r[k]["reward"] for r in runs) for k in ("heldout_sft", "heldout_rl")]
    lines.append(f"| median | | | | {fmt(median[0])} → {fmt(median[1])} | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--episodes", type=int, default=2, help="episodes per held-out prompt (128 prompts)")
    parser.add_argument("--config", default="agent_cpu.yaml")
    parser.add_argument("--work-dir", default=None, help="job directories and exported models (default: a temp dir)")
    parser.add_argument("--warm-start-seed", type=int, default=None,
                        help="start every seed from this seed's warm start (default: each seed builds its own)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="asyncrl-agent-bench-")
    os.makedirs(work, exist_ok=True)
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(args.config, args.overrides, seed, work, args.episodes, args.warm_start_seed))
        print(f"seed {seed}: {json.dumps(runs[-1])}", flush=True)
    print(table(runs))
    print(json.dumps({"bench": "agent_recipe", "config": args.config, "overrides": args.overrides, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
