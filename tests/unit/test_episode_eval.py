"""`asyncrl eval` on a job whose samples are episodes (generator/evaluation.py with an episode runner): each sample
is a whole episode scored as training scores it, an opening too long is skipped and counted, and the episode
metrics per data source (telemetry/eval_metrics.py::episode_metrics). A faithful fake runner and scorer: the real
runner is played by tests/e2e/test_tool_demo.py."""
import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest

from asyncrl.data.prompts import DatasetError
from asyncrl.generator.agents.episode import Episode, PromptTooLong
from asyncrl.generator.evaluation import evaluate
from asyncrl.telemetry.eval_metrics import episode_metrics


class Scorer:
    """The reward function: 1 when the last turn is the ground truth."""

    async def score(self, data_source, text, ground_truth, extra_info, prompt_id=None, prompt=None):
        return float(text == ground_truth), {}


class Runner:
    """Plays `row.plays` in turn: ("call", answer) calls a tool then answers, ("env", reward) is an environment's
    reward, "broken" an environment error, "long" an opening too long."""

    def __init__(self):
        self.env_errors, self.seen, self.played = Counter(), [], Counter()

    async def run(self, row, sampling):
        self.seen.append(sampling)
        play = row.plays[self.played[row.prompt_id] % len(row.plays)]
        self.played[row.prompt_id] += 1
        if play == "long":
            raise PromptTooLong("the opening with the tools is 99 tokens")
        if play == "broken":
            return Episode(prompt_len=1, turns=1, env_error="tool crashed")
        kind, value = play
        episode = Episode(prompt_len=1, turns=2 if kind == "call" else 1, tool_calls=int(kind == "call"),
                          loss_mask=[1, 1, 1])
        if kind == "env":
            episode.rewards = [value]
        else:
            episode.last_text = value
        return episode


def row(source, truth, plays):
    return SimpleNamespace(data_source=source, ground_truth=truth, extra_info={}, prompt_id=source, messages=[],
                           prompt_ids=[1], plays=plays)


def test_each_sample_is_an_episode_scored_as_training_scores_it():
    rows = [row("a", "42", [("call", "42"), ("call", "41")]), row("b", "x", [("env", 0.5), "broken"]),
            row("c", "y", ["long"])]
    runner = Runner()
    metrics = asyncio.run(evaluate(None, Scorer(), None, rows, 2, 1.0, 16, [1, 2], 1.0, episodes=runner))
    assert metrics["eval/a/mean_reward"] == 0.5 and metrics["eval/a/pass_at_2"] == 1.0  # the reward function
    assert metrics["eval/b/mean_reward"] == 0.25  # the environment's reward; a broken episode scores 0
    assert metrics["eval/all/prompts"] == 2.0 and metrics["eval/episodes_too_long"] == 1.0
    assert metrics["eval/a/tool_use"] == 1.0 and metrics["eval/b/tool_use"] == 0.0
    assert metrics["eval/all/turns/mean"] == pytest.approx((2 + 2 + 1 + 1) / 4)
    assert metrics["eval/a/length/mean"] == 3.0  # the tokens the model sampled over the episode
    assert all(s.temperature == 1.0 and s.top_k == -1 and s.max_tokens == 16 for s in runner.seen)


def test_an_evaluation_with_no_prompt_left_says_so():
    with pytest.raises(DatasetError, match="too long"):
        asyncio.run(evaluate(None, Scorer(), None, [row("c", "y", ["long"])], 2, 1.0, 16, [1], 1.0,
                             episodes=Runner()))


def test_episode_metrics_per_source_and_over_all():
    played = [("a", [Episode(prompt_len=1, turns=2, tool_calls=1), Episode(prompt_len=1, turns=1)]),
              ("b", [Episode(prompt_len=1, turns=3, tool_calls=2)])]
    assert episode_metrics(played) == {"eval/a/tool_use": 0.5, "eval/a/turns/mean": 1.5, "eval/all/tool_use": 2 / 3,
                                       "eval/all/turns/mean": 2.0, "eval/b/tool_use": 1.0, "eval/b/turns/mean": 3.0}
