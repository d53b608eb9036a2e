"""`asyncrl eval --checkpoint DIR --files a.parquet ...`: evaluate a checkpoint or an exported model offline and print
a table per data source (generator/evaluation.py), then one JSON line with every metric.

DIR is an HF model directory (`asyncrl export`'s output, or any model) or a learner checkpoint (a step-* directory
or a checkpoint root), which is exported to a temporary directory first. The engine, its settings and the reward
are the recipe's (generator.*, reward.*), so the numbers are those training optimises.
"""
import asyncio
import json
import os
import re
import sys
import tempfile


def model_dir_for(path: str, workdir: str) -> str:
    """An HF model directory for `path`: itself if it is one, else the learner checkpoint exported into workdir."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from asyncrl.learner.export import export_checkpoint

    return export_checkpoint(path, os.path.join(workdir, "model"), None)


def eval_rows(cfg) -> tuple[list, str]:
    """(the rows evaluated, what they are in words): eval.files; else data.val_fraction's held-out split of
    data.train_files (the rows the job held out of training, data/prompts.py::split_job_rows)."""
    from asyncrl.data.prompts import describe_files, describe_split, read_rows, split_job_rows

    if cfg.eval.files:
        return read_rows(cfg.eval.files), describe_files("eval.files", cfg.eval.files)
    return (split_job_rows(cfg.data, cfg.job.seed, cfg.data.train_files)[1],
            describe_split(cfg.data, cfg.data.train_files))


async def run_eval(cfg, model_path: str, say=print) -> dict:
    from transformers import AutoTokenizer

    from asyncrl.data.prompts import image_settings, tokenize_rows
    from asyncrl.generator.engines.factory import engine_options, make_engine
    from asyncrl.generator.evaluation import evaluate
    from asyncrl.generator.rewards.client import wait_for_server
    from asyncrl.generator.rewards.functions import check_builtin_rewards, uses_builtin_rewards
    from asyncrl.generator.rewards.scorer import RewardScorer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    raw, source = eval_rows(cfg)
    rows, skipped = tokenize_rows(raw, tokenizer, cfg.data.max_prompt_tokens,
                                  **image_settings(model_path, cfg.data, cfg.model.trust_remote_code))
    say(f"eval: on {source} ({len(rows)} prompts)")
    if skipped:
        say(f"eval: skipped {skipped} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if uses_builtin_rewards(cfg.reward):
        check_builtin_rewards({row.data_source for row in rows})
    scorer = RewardScorer(cfg.reward.path, cfg.reward.function, cfg.generator.reward_workers, cfg.reward.timeout_s,
                          source="eval", functions=cfg.reward.functions)
    engine = make_engine(cfg.generator.engine, engine_options(cfg.generator, cfg.model, model_path, cfg.job.seed,
                                                              max_images=cfg.data.max_images))
    await scorer.start()
    for url in scorer.servers:
        await wait_for_server(url, cfg.generator.connect_timeout_s, say)
    episodes = None
    try:
        await engine.start()
        if cfg.samples_episodes():
            episodes = episode_runner(cfg, engine, tokenizer)
            await episodes.start()
            say(f"eval: each sample is an episode of at most {cfg.rollout.max_turns} model turns")
        step = max(len(rows) // 10, 1)
        return await evaluate(engine, scorer, tokenizer, rows, cfg.eval.n, cfg.eval.temperature,
                              eval_max_tokens(cfg), list(cfg.eval.k_values), cfg.eval.pass_threshold,
                              on_done=lambda done, total: say(f"eval: {done}/{total} prompts")
                              if done % step == 0 or done == total else None, episodes=episodes)
    finally:
        if episodes is not None:
            await episodes.close()
        await engine.close()
        await scorer.close()


def eval_max_tokens(cfg) -> int:
    """Tokens per model turn: eval.max_tokens, else the recipe's rollout.max_tokens."""
    return cfg.eval.max_tokens or cfg.rollout.max_tokens


def episode_runner(cfg, engine, tokenizer):
    """The runner a generator of this job plays episodes with (agents/build.py), its rollout settings the
    evaluation's: an agent's endpoint samples with the rollout section it is built from, not with the sampling
    each episode is handed, so the evaluation's temperature, no top-k or top-p, and its max tokens go there too."""
    import copy

    from asyncrl.generator.agents.build import build_episode_runner

    # a copy with the evaluation's sampling set field by field: the rollout section's own check refuses T = 0
    # (training needs the logprobs greedy decoding does not give), and a greedy evaluation is exactly T = 0
    rollout = copy.copy(cfg.rollout)
    rollout.temperature, rollout.top_p, rollout.top_k = cfg.eval.temperature, 1.0, -1
    rollout.max_tokens = eval_max_tokens(cfg)
    return build_episode_runner(cfg.tools, cfg.env, cfg.agent, rollout, max_model_len=cfg.generator.max_model_len,
                                max_prompt_tokens=cfg.data.max_prompt_tokens,
                                tool_workers=cfg.generator.tool_workers, engine=engine, tokenizer=tokenizer)


METRIC_NAME = re.compile(r"prompts|mean_reward|length/mean|mean_at_\d+|pass_at_\d+|tool_use|turns/mean")
"""What follows `eval/<data_source>/` in eval_metrics' keys (data sources may contain "/" themselves)."""


def format_table(metrics: dict) -> str:
    """One row per data source (all last), one column per metric name."""
    sources = sorted((key[len("eval/"):-len("/prompts")] for key in metrics if key.endswith("/prompts")),
                     key=lambda s: (s == "all", s))
    columns = sorted({key[len(f"eval/{source}/"):] for source in sources for key in metrics
                      if key.startswith(f"eval/{source}/") and METRIC_NAME.fullmatch(key[len(f"eval/{source}/"):])})
    width = max(len(s) for s in sources + ["data_source"])
    lines = ["  ".join(["data_source".ljust(width), *(c.rjust(12) for c in columns)])]
    for source in sources:
        cells = [f"{metrics[f'eval/{source}/{c}']:.4g}".rjust(12) if f"eval/{source}/{c}" in metrics else
                 "-".rjust(12) for c in columns]
        lines.append("  ".join([source.ljust(width), *cells]))
    return "\n".join(lines)


def cmd_eval(cfg, args) -> int:
    if not cfg.eval.files and not cfg.data.val_fraction:
        print("asyncrl eval: give the prompts with --files or eval.files=[...] (or, for the split a job held out "
              "of its training data, that job's data.train_files and data.val_fraction)", file=sys.stderr)
        return 2
    if not os.path.exists(args.checkpoint):
        print(f"asyncrl eval: {args.checkpoint} does not exist", file=sys.stderr)
        return 2
    from asyncrl.data.prompts import DatasetError
    from asyncrl.learner.checkpoint import CheckpointError

    with tempfile.TemporaryDirectory(prefix="asyncrl-eval-") as workdir:
        try:
            metrics = asyncio.run(run_eval(cfg, model_dir_for(args.checkpoint, workdir)))
        except (CheckpointError, DatasetError) as err:
            print(f"asyncrl eval: {err}", file=sys.stderr)
            return 2
    print(format_table(metrics))
    print(json.dumps(metrics, sort_keys=True))
    return 0
