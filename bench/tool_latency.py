"""Asynchrony on an agent workload: trained samples/s at η = 0 and at η > 0 when episodes wait on tools whose
latency is heavy-tailed (most calls fast, a few very slow), as agent rollouts do. It reports; it does not assert.

The workload: the demo's sort task as 2-turn episodes. After the model's first answer an environment "tool" is
called (generator/agents/environment.py interface) that takes `--fast-s` seconds, or `--slow-s` with probability
`--slow-p`, then asks the model to answer again; the reward function scores the last answer. Waiting on the tool
costs no CPU, so asynchrony should hide it: at η = 0 each step waits for its slowest episodes, at η > 0 the
generator samples other groups meanwhile (`generator.max_inflight_groups`). The demo model is used with a chat
template that ends each assistant turn with the stop token, so turns can be appended (docs/agents.md).

Per run, from its progress.jsonl: trained samples/s between the first and the last step, the learner's idle
fraction, staleness. The ratio is η > 0 over η = 0, per seed; the table shows the median and range. Usage:
    python -m asyncrl.bench.tool_latency [--seeds 0 1 2] [--etas 0 2] [--steps 30] [--slow-p 0.1] [--slow-s 2]
        [overrides...]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

from asyncrl.bench.time_to_reward import median_or_none, read_progress, run_asyncrl

ENV_SOURCE = '''
import asyncio
import random

from asyncrl.generator.agents.environment import StepResult

FAST_S, SLOW_S, SLOW_P = {fast_s!r}, {slow_s!r}, {slow_p!r}


class SlowToolEnv:
    """Turn 1: the model answers; a tool takes FAST_S, or SLOW_S with probability SLOW_P; the model answers again
    (the reward function scores that answer)."""

    def __init__(self):
        self.turns = 0

    async def reset(self, row):
        self.task = row["prompt"][0]["content"]
        return None

    async def step(self, text):
        self.turns += 1
        if self.turns == 2:
            return StepResult(done=True)
        await asyncio.sleep(SLOW_S if random.random() < SLOW_P else FAST_S)
        return StepResult(messages=[{{"role": "user", "content": self.task}}], tool_calls=1)
'''
APPENDABLE_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}"
                       "{% endfor %}")


def appendable_demo_model(cfg, workdir: str) -> tuple[str, list]:
    """The demo model and data, the model's copy given a chat template whose assistant turns end with <eos>."""
    from asyncrl.launch.demo import prepare_demo

    model_dir, files = prepare_demo(cfg.demo, cfg.job.seed, say=lambda message: None)
    copy = os.path.join(workdir, "model")
    shutil.copytree(model_dir, copy, dirs_exist_ok=True)
    config_path = os.path.join(copy, "tokenizer_config.json")
    with open(config_path) as handle:
        tokenizer_config = json.load(handle)
    tokenizer_config["chat_template"] = APPENDABLE_TEMPLATE
    with open(config_path, "w") as handle:
        json.dump(tokenizer_config, handle)
    for name in ("chat_template.jinja", "chat_template.json"):  # a separate template file would win
        if os.path.exists(os.path.join(copy, name)):
            os.remove(os.path.join(copy, name))
    return copy, files


def summarize(progress: list, samples_per_step: int) -> dict:
    elapsed = [row["elapsed_s"] for row in progress]
    span = elapsed[-1] - elapsed[0]

    def mean_of(key):
        values = [row[key] for row in progress if key in row]
        return sum(values) / len(values) if values else None

    return {"steps": len(progress),
            "samples_per_s": samples_per_step * (len(progress) - 1) / span if span > 0 else None,
            "learner_idle_frac": mean_of("timing/learner/idle_frac"),
            "staleness_mean": mean_of("buffer/staleness/mean"),
            "turns_mean": mean_of("rollout/turns/mean")}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--etas", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fast-s", type=float, default=0.02)
    parser.add_argument("--slow-s", type=float, default=2.0)
    parser.add_argument("--slow-p", type=float, default=0.1)
    parser.add_argument("--inflight", type=int, default=64, help="generator.max_inflight_groups")
    parser.add_argument("--keep", help="keep every run's job directory under this path")
    parser.add_argument("overrides", nargs="*", help="overrides for every run")
    args = parser.parse_args(argv)
    if 0 not in args.etas or len(args.etas) < 2:
        parser.error("--etas needs 0 (the baseline) and at least one η > 0")
    from asyncrl.configs import load_config

    cfg = load_config("demo_cpu.yaml", args.overrides)
    samples_per_step = cfg.buffer.groups_per_step * cfg.rollout.n
    workdir = args.keep or tempfile.mkdtemp(prefix="asyncrl-tool-latency-")
    os.makedirs(workdir, exist_ok=True)
    model_dir, files = appendable_demo_model(cfg, workdir)
    env_path = os.path.join(workdir, "slow_tool_env.py")
    with open(env_path, "w") as handle:
        handle.write(ENV_SOURCE.format(fast_s=args.fast_s, slow_s=args.slow_s, slow_p=args.slow_p))
    episode = [f"model.path={model_dir}", f"data.train_files=[{files[0]}]", f"env.path={env_path}",
               "env.name=SlowToolEnv", "rollout.max_turns=2", "algo.dynamic_sampling=false",
               f"generator.max_inflight_groups={args.inflight}"]
    runs: dict = {eta: [] for eta in args.etas}
    for seed in args.seeds:
        for eta in args.etas:
            job_dir = os.path.join(workdir, f"seed{seed}-eta{eta}")
            run_asyncrl(job_dir, "demo_cpu.yaml", seed, args.steps,
                        [*args.overrides, *episode, f"buffer.max_staleness={eta}"])
            run = summarize(read_progress(job_dir), samples_per_step)
            runs[eta].append({"seed": seed, **run})
            print(f"eta={eta} seed {seed}: {json.dumps(run)}", file=sys.stderr, flush=True)
    ratios = {eta: [run["samples_per_s"] / base["samples_per_s"] for run, base in zip(runs[eta], runs[0])]
              for eta in args.etas if eta > 0}
    print(f"tool latency {args.fast_s:g} s, or {args.slow_s:g} s with p = {args.slow_p:g}; {args.steps} steps; "
          f"median [min, max] over seeds {args.seeds}")
    print("| run | trained samples/s | vs η = 0 | learner idle | staleness |")
    print("|---|---|---|---|---|")
    for eta in args.etas:
        rate = [run["samples_per_s"] for run in runs[eta]]
        idle = [run["learner_idle_frac"] for run in runs[eta] if run["learner_idle_frac"] is not None]
        stale = [run["staleness_mean"] for run in runs[eta] if run["staleness_mean"] is not None]
        ratio = f"{median_or_none(ratios[eta]):.2f}× [{min(ratios[eta]):.2f}, {max(ratios[eta]):.2f}]" if eta else "1"
        print(f"| η = {eta} | {median_or_none(rate):.1f} [{min(rate):.1f}, {max(rate):.1f}] | {ratio} | "
              f"{median_or_none(idle) if idle else float('nan'):.2f} | "
              f"{median_or_none(stale) if stale else float('nan'):.2f} |")
    result = {"bench": "tool_latency", "seeds": args.seeds, "steps": args.steps,
              "latency": {"fast_s": args.fast_s, "slow_s": args.slow_s, "slow_p": args.slow_p},
              "ratio": {str(eta): median_or_none(values) for eta, values in ratios.items()},
              "runs": {str(eta): values for eta, values in runs.items()}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
