"""Agents written against the OpenAI API: a user's `async def episode(row, client) -> reward` is run `n` times per
admitted prompt, each with an official `openai.AsyncOpenAI` client whose API key names its session on the
generator's endpoint (openai_server.py). What the endpoint recorded becomes the episode; the function's return
value is its reward (None: the job's reward function scores the last model turn).

Contract of `run(row, sampling)`, the same as `EpisodeRunner.run`: it waits for the user's function, at most
`agent.timeout_s`. One that fails ends its episode as `env_error` (scored 0), counted in
`rollout/env_errors/<reason>` under one of AGENT_FAILURES, the exception's type and message in the log: the reasons
are few and fixed, so the metrics stay bounded however many kinds of exception agents raise.
"""
import asyncio
import inspect
import logging
import math
import uuid
from collections import Counter

from asyncrl.generator.agents.episode import Episode, row_dict
from asyncrl.generator.agents.openai_session import AgentSession
from asyncrl.generator.user_code.loader import load_from_file

log = logging.getLogger(__name__)


AGENT_FAILURES = {
    "agent_error": "the function raised (its own bug, or a client error other than a refusal)",
    "agent_refused": "the function let an endpoint refusal (openai.APIStatusError) escape: "
                     "rollout/http_refusals/<cause> says which",
    "agent_timeout": "the function ran past agent.timeout_s, or its client timed out",
    "no_requests": "the function returned without calling the endpoint",
    "bad_reward": "the function returned something other than a finite number or None",
}
"""rollout/env_errors/<reason> of an agent episode: why it ended as env_error."""


def failure_reason(err: BaseException) -> str:
    """The AGENT_FAILURES reason for what the agent's function raised."""
    import openai

    if isinstance(err, (asyncio.TimeoutError, openai.APITimeoutError)):
        return "agent_timeout"
    if isinstance(err, openai.APIStatusError):
        return "agent_refused"
    return "agent_error"


class AgentLoadError(ValueError):
    """agent.path / agent.function do not name an async function."""


def load_agent_function(path: str, name: str):
    try:
        fn = load_from_file(path, name, "agent.path")
    except FileNotFoundError as err:
        raise AgentLoadError(str(err)) from None
    if not inspect.iscoroutinefunction(fn):
        raise AgentLoadError(f"agent.function {name!r} in {path} must be an `async def episode(row, client)`")
    return fn


class OpenAIAgentRunner:
    def __init__(self, endpoint, episode_fn, tokenizer, budget, max_tokens: int, timeout_s: float,
                 per_turn: bool = False):
        self.endpoint, self.episode_fn, self.tokenizer, self.per_turn = endpoint, episode_fn, tokenizer, per_turn
        self.budget, self.max_tokens, self.timeout_s = budget, max_tokens, timeout_s
        self.env_errors: Counter = Counter()

    async def start(self) -> None:
        """Serve the endpoint (before any episode runs)."""
        await self.endpoint.start()

    async def close(self) -> None:
        await self.endpoint.close()

    def metrics(self) -> dict:
        """Agent failures by reason, and the endpoint's refusals and tool-call errors."""
        return {**{f"rollout/env_errors/{reason}": float(count) for reason, count in sorted(self.env_errors.items())},
                **self.endpoint.metrics()}

    async def run(self, row, sampling) -> Episode:
        from openai import AsyncOpenAI

        session = AgentSession(uuid.uuid4().hex, self.tokenizer, self.budget, self.max_tokens, per_turn=self.per_turn)
        self.endpoint.sessions[session.id] = session
        client = AsyncOpenAI(base_url=self.endpoint.url, api_key=session.id, max_retries=0, timeout=self.timeout_s)
        reward, failure = None, None
        try:
            reward = await asyncio.wait_for(self.episode_fn(row_dict(row), client), self.timeout_s)
        except Exception as err:  # the agent's own bug, a timeout, or an endpoint refusal it did not handle
            failure = failure_reason(err)
            log.warning("agent episode on %s failed (%s): %s: %s", row.prompt_id, failure, type(err).__name__, err)
        finally:
            del self.endpoint.sessions[session.id]
            await client.close()
        episode = session.episode
        if episode is None and failure is None:
            failure = "no_requests"
            log.warning("agent episode on %s returned without calling the endpoint", row.prompt_id)
        if failure is None and reward is not None:
            if not isinstance(reward, (int, float)) or not math.isfinite(reward):
                failure = "bad_reward"
                log.warning("agent episode on %s returned %r: a reward is a finite number or None", row.prompt_id,
                            reward)
            else:
                episode.rewards.append(float(reward))
        if failure is not None:
            self.env_errors[failure] += 1
            episode = episode or Episode(prompt_len=len(row.prompt_ids), sequence=list(row.prompt_ids),
                                         per_turn=self.per_turn)
            episode.finish_reason, episode.env_error = "env_error", failure
        elif episode.finish_reason == "stop" and episode.turns >= self.budget.max_turns:
            episode.finish_reason = "max_turns"
        return episode
