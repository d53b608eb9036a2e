"""Evaluating a model on held-out prompts: n samples per prompt from an engine, scored by the job's reward.

Two callers share `sample_and_score`: `asyncrl eval` (launch/evaluate.py -> `evaluate`), offline on a checkpoint or
an exported model, reduced to metrics per data source (telemetry/eval_metrics.py); and the rollout loop's answer to
an evaluation round of the learner (buffer/eval_rounds.py), sampled at the round's version.

Samples come from the same engines and the same reward path as training (generator/engines,
generator/rewards/scorer.py), so an evaluation measures what training optimises, without training's shaping
(reward.overlong_*): greedy by default (eval.temperature = 0), with at most `concurrency` prompts in flight offline.
A prompt too long for data.max_prompt_tokens is skipped and counted by the caller.
"""
import asyncio

from asyncrl.buffer.group import Sampling
from asyncrl.generator.sampling import score_text
from asyncrl.telemetry.eval_metrics import eval_metrics


def eval_sampling(temperature: float, max_tokens: int) -> Sampling:
    """Evaluations sample from the whole distribution at `temperature` (no top-k, no top-p)."""
    return Sampling(temperature=temperature, top_p=1.0, top_k=-1, max_tokens=max_tokens)


async def sample_and_score(engine, scorer, tokenizer, row, sampling: Sampling, n: int) -> tuple[list, list]:
    """(rewards, completion lengths) of n samples of `row` (a PromptRow or a dealt prompt)."""
    completions = await engine.sample(row.prompt_ids, sampling, n)
    scores = await asyncio.gather(*(score_text(scorer, row, tokenizer.decode(c.token_ids, skip_special_tokens=True))
                                    for c in completions))
    return [reward for reward, _ in scores], [len(c.token_ids) for c in completions]


async def evaluate(engine, scorer, tokenizer, rows: list, n: int, temperature: float, max_tokens: int, ks: list,
                   pass_threshold: float, concurrency: int = 8, on_done=None) -> dict:
    """`rows`: PromptRows (data/prompts.py). `on_done(done, total)` reports progress."""
    sampling = eval_sampling(temperature, max_tokens)
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(row):
        nonlocal done
        async with gate:
            rewards, lengths = await sample_and_score(engine, scorer, tokenizer, row, sampling, n)
        done += 1
        if on_done is not None:
            on_done(done, len(rows))
        return row.data_source, rewards, lengths

    results = await asyncio.gather(*(one(row) for row in rows))
    return eval_metrics(list(results), ks, pass_threshold)
