"""TRL's `GRPOTrainer` on any task of bench/time_to_reward.py's suite, with the task's recipe and overrides (TRL is
the `bench` extra, never a runtime dependency of asyncrl).

Same warm-started model, tokenizer, prompts (the rows `asyncrl run` trains on: data.train_files or reasoning-gym's,
less data.val_fraction's held-out split) and reward function (reward.path / reward.function) as `asyncrl run`; the
same batch (groups_per_step prompts × rollout.n samples, at most rollout.max_tokens new tokens, the recipe's
temperature), lr with a linear warmup then the recipe's schedule (`trl_lr_schedule`), AdamW, grad clip, PPO clip
ε = 0.2 / 0.28 with one update per batch, token-mean loss (`loss_type="dapo"`), no KL (`beta=0`), generation with HF `generate`. Not dynamic sampling:
GRPOTrainer has no zero-variance filter, so its batches keep the groups that teach nothing (its reward is over
everything it sampled, like asyncrl's `reward/sampled_mean`). Each step is appended to `<job dir>/progress.jsonl` in
asyncrl's format (step, elapsed_s, reward/sampled_mean and reward/mean, the same number: every group is trained), so
both sides are read alike. The final model and its tokenizer are saved to `<job dir>/final` for the judge
(bench/judge.py).

Multi-turn tool tasks are not run (`unsupported_reason`): TRL 1.16's GRPOTrainer takes `tools=[...]`, but refuses a
chat template that renders tool calls as plain content (`supports_tool_calling`), as the tool demo's does (its
model learnt `<tool_call>{...}</tool_call>` in its text), and parses calls only for the chat templates it knows
(`add_response_schema`: "Unrecognized chat template"). Running it would need another template, so other prompts
than asyncrl's, and its `max_completion_length` caps a whole episode where asyncrl's rollout.max_tokens caps each
turn: not identical settings. Usage:
    python -m asyncrl.bench.trl_grpo --job-dir DIR [--config RECIPE] --seed S --steps N [overrides...]
"""
import argparse
import json
import os
import time


def reward_function(cfg):
    """TRL's reward signature around the recipe's verl-style reward: completions are chat messages."""
    from asyncrl.generator.rewards.functions import load_reward_fn, score

    compute_score = load_reward_fn(cfg.reward.path, cfg.reward.function)

    def reward(prompts, completions, data_source, ground_truth, extra_info, **kwargs):
        rewards = []
        for completion, source, truth, extra in zip(completions, data_source, ground_truth, extra_info):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            rewards.append(score(compute_score, source, text, truth, json.loads(extra))[0])
        return rewards

    return reward


class ProgressWriter:
    """A TRL callback writing asyncrl's progress.jsonl: wall time since training began, and each step's reward."""

    def __init__(self, path: str):
        from transformers import TrainerCallback

        writer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                writer.started = time.monotonic()

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    writer.write(state.global_step, logs)

        self.path = path
        self.started = time.monotonic()
        self.callback = Callback()

    def write(self, step: int, logs: dict) -> None:
        reward = float(logs["reward"])
        row = {"step": step, "elapsed_s": time.monotonic() - self.started, "reward/sampled_mean": reward,
               "reward/mean": reward}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def unsupported_reason(cfg) -> str | None:
    """Why this bench cannot run TRL with settings identical to this config's (see the module docstring), or None."""
    from asyncrl.bench.suite.task import multi_turn_tools

    tools = multi_turn_tools(cfg)
    if tools is not None:
        return (f"multi-turn tools ({', '.join(tools) or 'rollout.max_turns > 1'}): TRL 1.16 GRPOTrainer refuses a "
                f"chat template that renders tool calls as content and parses no unknown template's calls")
    return None


def trl_lr_schedule(learner) -> dict:
    """The recipe's learner.lr_schedule as transformers' scheduler (GRPOConfig's lr_scheduler_type and kwargs):
    both decay from the end of the warmup to 0, or to min_lr_ratio of the peak, at the run's last step
    (learner.total_steps is the run's steps on both sides). transformers has no linear decay to a floor: that one is
    refused, not approximated."""
    if learner.lr_schedule == "constant":
        return {"lr_scheduler_type": "constant_with_warmup"}
    if learner.min_lr_ratio == 0:
        return {"lr_scheduler_type": learner.lr_schedule}
    if learner.lr_schedule == "cosine":
        return {"lr_scheduler_type": "cosine_with_min_lr",
                "lr_scheduler_kwargs": {"min_lr_rate": learner.min_lr_ratio}}
    raise SystemExit(f"bench.trl_grpo: transformers has no linear decay to a floor (learner.lr_schedule=linear, "
                     f"learner.min_lr_ratio={learner.min_lr_ratio}): not identical settings, not run")


def training_rows(cfg, files: list) -> list:
    """The rows `asyncrl run` trains on: the files (or reasoning-gym's rows), less data.val_fraction's split."""
    from asyncrl.data.prompts import split_job_rows

    return split_job_rows(cfg.data, cfg.job.seed, files)[0]


def run_trl(job_dir: str, recipe: str, seed: int, steps: int, overrides: list, threads: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.configs import load_config
    from asyncrl.launch.job import resolve_rl_inputs

    if threads:
        torch.set_num_threads(threads)
    cfg = load_config(recipe, overrides)
    reason = unsupported_reason(cfg)
    if reason:
        raise SystemExit(f"bench.trl_grpo: not run: {reason}")
    model_dir, files = resolve_rl_inputs(cfg)
    dataset = Dataset.from_list([{"prompt": row["prompt"], "data_source": row["data_source"],
                                  "ground_truth": row["reward_model"]["ground_truth"],
                                  "extra_info": json.dumps(row.get("extra_info"))}
                                 for row in training_rows(cfg, files)])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = cfg.buffer.groups_per_step * cfg.rollout.n
    args = GRPOConfig(
        output_dir=os.path.join(job_dir, "trl"), max_steps=steps, seed=seed, use_cpu=True, report_to="none",
        per_device_train_batch_size=batch, num_generations=cfg.rollout.n, gradient_accumulation_steps=1,
        max_completion_length=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature, top_k=0, top_p=1.0,
        learning_rate=cfg.learner.lr, warmup_steps=cfg.learner.warmup_steps, **trl_lr_schedule(cfg.learner),
        weight_decay=cfg.learner.weight_decay, adam_beta1=cfg.learner.adam_beta1, adam_beta2=cfg.learner.adam_beta2,
        max_grad_norm=cfg.learner.grad_clip, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", beta=0.0,
        num_iterations=1, logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        bf16=False, gradient_checkpointing=False,  # TRL 1.16 defaults both to True; asyncrl trains fp32, no checkpointing
    )
    progress = ProgressWriter(os.path.join(job_dir, "progress.jsonl"))
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_function(cfg)], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[progress.callback])
    trainer.train()
    final = os.path.join(job_dir, "final")
    trainer.save_model(final)
    tokenizer.save_pretrained(final)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job-dir", required=True)
    parser.add_argument("--config", default="demo_cpu.yaml", help="the task's recipe (asyncrl run --config)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    os.makedirs(args.job_dir, exist_ok=True)
    run_trl(args.job_dir, args.config, args.seed, args.steps, args.overrides, args.threads)


if __name__ == "__main__":
    main()
