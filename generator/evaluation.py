"""Evaluating a model on held-out prompts: n samples per prompt from an engine, scored by the job's reward, reduced
to metrics per data source (telemetry/eval_metrics.py). `asyncrl eval` (launch/evaluate.py) runs it offline on a checkpoint
or an exported model.

Samples come from the same engines and the same reward path as training (generator/engines,
generator/rewards/scorer.py), so an evaluation measures what training optimises; greedy by default
(eval.temperature = 0), with at most `concurrency` prompts in flight. A prompt too long for data.max_prompt_tokens is
skipped and counted.
"""
import asyncio

from asyncrl.buffer.group import Sampling
from asyncrl.telemetry.eval_metrics import eval_metrics


async def evaluate(engine, scorer, tokenizer, rows: list, n: int, temperature: float, max_tokens: int, ks: list,
                   pass_threshold: float, concurrency: int = 8, on_done=None) -> dict:
    """`rows`: PromptRows (data/prompts.py). `on_done(done, total)` reports progress."""
    sampling = Sampling(temperature=temperature, top_p=1.0, top_k=-1, max_tokens=max_tokens)
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(row):
        nonlocal done
        async with gate:
            completions = await engine.sample(row.prompt_ids, sampling, n)
            texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
            scores = await asyncio.gather(*(scorer.score(row.data_source, text, row.ground_truth, row.extra_info,
                                                         prompt_id=row.prompt_id, prompt=row.messages)
                                            for text in texts))
        done += 1
        if on_done is not None:
            on_done(done, len(rows))
        return row.data_source, [reward for reward, _ in scores], [len(c.token_ids) for c in completions]

    results = await asyncio.gather(*(one(row) for row in rows))
    return eval_metrics(list(results), ks, pass_threshold)
