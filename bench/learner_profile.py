"""Where the demo's learner step spends its time: `torch.profiler` over asyncrl's `train_step` at the demo's real
shapes and settings (it reports; it does not assert).

The batch is what the demo's learner trains on: the demo's cached warm-start model (`prepare_demo`) samples
`rollout.n` completions at `rollout.temperature` for `buffer.groups_per_step` of the demo's prompts, scored by the
task's reward, with half the groups one version stale (the demo runs at `buffer.max_staleness` 1, so A-3PO's
interpolation has something to do). The step runs with the recipe's algo section, `learner.torch_threads`,
`learner.max_tokens_per_microbatch` and `learner.logprob_chunk_tokens`, on the same batch every time.
Prints the top ops by self CPU time and one JSON line with the step's median time (unprofiled) and the ops a step
dispatches. Usage:
    python -m asyncrl.bench.learner_profile [--recipe demo_cpu] [--steps N] [--top K] [overrides ...]
"""
import argparse
import json
import statistics
import time

VERSION = 1
"""The learner's version during the profiled steps; half the groups carry VERSION - 1 (one step stale)."""


def demo_groups(model, tokenizer, prompts: list, n: int, temperature: float, max_tokens: int, seed: int) -> list:
    """One group per prompt (data/prompts.py's PromptRow): `n` sampled completions with their sampling logprobs (at `temperature`, as the
    generator reports them) and the task's reward. Every other group is one version stale."""
    import numpy as np
    import torch

    from asyncrl.buffer.group import Group, Sample, Sampling
    from asyncrl.generator.tasks.exact_match import compute_score

    torch.manual_seed(seed)
    groups = []
    for index, row in enumerate(prompts):
        prompt_ids = list(row.prompt_ids)
        inputs = torch.tensor([prompt_ids] * n)
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                                 output_scores=True, return_dict_in_generate=True,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        completions = out.sequences[:, len(prompt_ids):]
        scores = torch.stack(out.scores, 1).float().log_softmax(-1)  # [n, T, V], already divided by temperature
        token_logprobs = scores.gather(-1, completions[..., None]).squeeze(-1)
        version = VERSION - index % 2
        samples = []
        for ids, logprobs in zip(completions.tolist(), token_logprobs):
            length = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
            text = tokenizer.decode(ids[:length], skip_special_tokens=True)
            reward = float(compute_score(row.data_source, text, row.ground_truth)["score"])
            samples.append(Sample(completion_ids=np.array(ids[:length], np.int32),
                                  logprobs=logprobs[:length].numpy().astype(np.float32),
                                  versions=np.full(length, version, np.int32), reward=reward,
                                  finish_reason="stop"))
        groups.append(Group(group_id=str(index), prompt_id=str(index), generator_id="profile",
                            prompt_ids=np.array(prompt_ids, np.int32), samples=samples,
                            sampling=Sampling(temperature=temperature), created_at=0.0))
    return groups


def build_demo_step(recipe: str, overrides: list, seed: int = 0):
    """(model, optimizer, scheduler, groups, algo, settings) of the demo's learner, the batch sampled once."""
    import dataclasses

    import torch

    from asyncrl.configs import load_config
    from asyncrl.data.prompts import read_rows, tokenize_rows
    from asyncrl.launch.demo import prepare_demo
    from asyncrl.learner.build import build_optimizer, shard_model
    from asyncrl.learner.loop import loop_settings
    from asyncrl.learner.model import load_model, load_tokenizer
    from asyncrl.learner.parallel import ParallelState

    cfg = load_config(recipe, overrides)
    model_dir, files = prepare_demo(cfg.demo, cfg.job.seed, say=lambda *_: None)
    if cfg.learner.torch_threads:
        torch.set_num_threads(cfg.learner.torch_threads)
    model = load_model(model_dir, cfg.learner.dtype, False, cfg.learner.attn_implementation)
    tokenizer = load_tokenizer(model_dir)
    prompts, _ = tokenize_rows(read_rows(files)[:cfg.buffer.groups_per_step], tokenizer, cfg.data.max_prompt_tokens)
    groups = demo_groups(model.eval(), tokenizer, prompts, cfg.rollout.n, cfg.rollout.temperature,
                         cfg.rollout.max_tokens, seed)
    # placed as the learner places it: on CPU under learner.autocast, that switches attention to fp32
    model = shard_model(model, cfg.learner, ParallelState()).train()
    optimizer, scheduler = build_optimizer(model, cfg.learner)
    settings = dataclasses.replace(loop_settings(cfg, ParallelState()).step, version=VERSION)
    return model, optimizer, scheduler, groups, cfg.algo, settings


def time_steps(step, count: int) -> list:
    """Seconds of each of `count` calls of `step()`."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="demo_cpu.yaml")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps (after 3 warm-up steps)")
    parser.add_argument("--top", type=int, default=25, help="rows of the ops table")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. learner.torch_threads=2")
    args = parser.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from asyncrl.learner.train_step import train_step

    model, optimizer, scheduler, groups, algo, settings = build_demo_step(args.recipe, args.overrides)
    # a tiny learning rate: the weights (and so the batch's ratios) stay where the sampler left them
    for param_group in optimizer.param_groups:
        param_group["lr"] = 1e-9

    def step():
        train_step(model, optimizer, scheduler, groups, algo, settings)

    time_steps(step, 3)
    unprofiled = time_steps(step, args.steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_steps(step, args.steps)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    aten = [event for event in events if event.key.startswith("aten::")]
    tokens = sum(len(g.prompt_ids) + len(s.completion_ids) for g in groups for s in g.samples)
    result = {"bench": "learner_profile", "recipe": args.recipe, "overrides": args.overrides,
              "threads": torch.get_num_threads(), "rows": sum(len(g.samples) for g in groups), "tokens": tokens,
              "step_s_median": statistics.median(unprofiled), "step_s_min": min(unprofiled),
              "step_s_max": max(unprofiled), "tokens_per_s": tokens / statistics.median(unprofiled),
              # the load-independent part of the profile: how many ops a step dispatches, and their CPU time
              "aten_calls_per_step": sum(event.count for event in aten) / args.steps,
              "self_cpu_s_per_step": sum(event.self_cpu_time_total for event in events) / 1e6 / args.steps}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
