"""Evaluating a model on held-out prompts: n samples per prompt from an engine, scored by the job's reward.

Two callers share `sample_and_score`: `asyncrl eval` (launch/evaluate.py -> `evaluate`), offline on a checkpoint or
an exported model, reduced to metrics per data source (telemetry/eval_metrics.py); and the rollout loop's answer to
an evaluation round of the learner (buffer/eval_rounds.py), sampled at the round's version.

Samples come from the same engines and the same reward path as training (generator/engines,
generator/rewards/scorer.py), so an evaluation measures what training optimises, without training's shaping
(reward.overlong_*): greedy by default (eval.temperature = 0), with at most `concurrency` prompts in flight offline.
A prompt too long for data.max_prompt_tokens is skipped and counted by the caller.

A job whose samples are episodes (tools, an environment, an agent) is evaluated on episodes, not single turns:
`asyncrl eval` plays each held-out prompt n times through the same episode runner a generator uses
(agents/build.py), at the evaluation's sampling, and scores each episode as training does. The rollout loop's
evaluation rounds stay single-turn (configs/run_config.py::training_eval_blocker turns them off for such jobs).
"""
import asyncio

from asyncrl.buffer.group import Sampling
from asyncrl.data.prompts import DatasetError
from asyncrl.generator.agents.episode import PromptTooLong
from asyncrl.generator.sampling import episode_reward, image_inputs, score_text
from asyncrl.telemetry.eval_metrics import episode_metrics, eval_metrics


def eval_sampling(temperature: float, max_tokens: int) -> Sampling:
    """Evaluations sample from the whole distribution at `temperature` (no top-k, no top-p)."""
    return Sampling(temperature=temperature, top_p=1.0, top_k=-1, max_tokens=max_tokens)


async def sample_and_score(engine, scorer, tokenizer, row, sampling: Sampling, n: int) -> tuple[list, list, list]:
    """(rewards, completion lengths, completion texts) of n samples of `row` (a PromptRow or a dealt prompt)."""
    completions = await engine.sample(row.prompt_ids, sampling, n, **image_inputs(row))
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    scores = await asyncio.gather(*(score_text(scorer, row, text) for text in texts))
    return [reward for reward, _ in scores], [len(c.token_ids) for c in completions], texts


async def play_and_score(episodes, scorer, row, sampling: Sampling, n: int) -> tuple[list, list, list]:
    """(rewards, model tokens, episodes) of n episodes of `row` played by `episodes` (agents/episode.py's runner or
    the agent runner), each scored as training scores it (sampling.py::episode_reward)."""
    runs = await asyncio.gather(*(episodes.run(row, sampling) for _ in range(n)))
    scores = await asyncio.gather(*(episode_reward(scorer, row, run, episodes.env_errors) for run in runs))
    return [reward for reward, _ in scores], [run.model_tokens() for run in runs], list(runs)


async def evaluate(engine, scorer, tokenizer, rows: list, n: int, temperature: float, max_tokens: int, ks: list,
                   pass_threshold: float, concurrency: int = 8, on_done=None, episodes=None) -> dict:
    """`rows`: PromptRows (data/prompts.py). `on_done(done, total)` reports progress. With `episodes` (a started
    episode runner: the job has tools, an environment or an agent), each sample is a whole episode, its reward the
    episode's, its length the tokens the model sampled over its turns; a prompt whose opening with the tools is
    too long is skipped and counted (`eval/episodes_too_long`), as a generator skips it."""
    sampling = eval_sampling(temperature, max_tokens)
    gate = asyncio.Semaphore(concurrency)
    done, too_long, played = 0, 0, []

    async def one(row):
        nonlocal done, too_long
        async with gate:
            if episodes is None:
                rewards, lengths, _ = await sample_and_score(engine, scorer, tokenizer, row, sampling, n)
            else:
                try:
                    rewards, lengths, runs = await play_and_score(episodes, scorer, row, sampling, n)
                    played.append((row.data_source, runs))
                except PromptTooLong:
                    too_long += 1
                    rewards = None
        done += 1
        if on_done is not None:
            on_done(done, len(rows))
        return None if rewards is None else (row.data_source, rewards, lengths)

    results = [result for result in await asyncio.gather(*(one(row) for row in rows)) if result is not None]
    if not results:
        raise DatasetError(f"no prompt could be evaluated: all {len(rows)} openings are too long for "
                         f"data.max_prompt_tokens with the tools")
    metrics = eval_metrics(results, ks, pass_threshold)
    if episodes is not None:
        metrics.update(episode_metrics(played))
        metrics["eval/episodes_too_long"] = float(too_long)
        metrics.update({f"eval/env_errors/{reason}": float(count)
                        for reason, count in sorted(episodes.env_errors.items())})
    return metrics
