"""Agents written against the OpenAI API (or Anthropic's): a user's `async def episode(row, client) -> reward` is
run `n` times per admitted prompt, each with an official `openai.AsyncOpenAI` client whose API key names its
session on the generator's endpoint (openai_server.py). What the endpoint recorded becomes the episode; the
function's return value is its reward (None: the job's reward function scores the last model turn). A function
whose second parameter is named `anthropic_client`, `async def episode(row, anthropic_client)`, gets an official
`anthropic.AsyncAnthropic` client instead, pointed at the same endpoint's `/v1/messages` with the same key: the
parameter's name says which API the agent was written against, and nothing else changes.

Contract of `run(row, sampling)`, the same as `EpisodeRunner.run`: it waits for the user's function, at most
`agent.timeout_s`. One that fails ends its episode as `env_error` (scored 0), counted in
`rollout/env_errors/<reason>` under one of AGENT_FAILURES, the exception's type and message in the log: the reasons
are few and fixed, so the metrics stay bounded however many kinds of exception agents raise.
"""
import asyncio
import inspect
import importlib.util
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
    "agent_refused": "the function let an endpoint refusal (openai's or anthropic's APIStatusError) escape: "
                     "rollout/http_refusals/<cause> says which",
    "agent_timeout": "the function ran past agent.timeout_s, or its client timed out",
    "no_requests": "the function returned without calling the endpoint",
    "bad_reward": "the function returned something other than a finite number or None",
}
"""rollout/env_errors/<reason> of an agent episode: why it ended as env_error."""


ANTHROPIC_PARAMETER = "anthropic_client"
"""The name of an agent function's second parameter that asks for an `anthropic.AsyncAnthropic` client."""


def client_errors() -> tuple[tuple, tuple]:
    """(timeouts, refusals): the client exception types that say the endpoint timed out or refused, of the
    `openai` package and, when it is installed, of `anthropic`."""
    import openai

    timeouts, refusals = [asyncio.TimeoutError, openai.APITimeoutError], [openai.APIStatusError]
    try:
        import anthropic
    except ImportError:
        return tuple(timeouts), tuple(refusals)
    return (*timeouts, anthropic.APITimeoutError), (*refusals, anthropic.APIStatusError)


def failure_reason(err: BaseException) -> str:
    """The AGENT_FAILURES reason for what the agent's function raised."""
    timeouts, refusals = client_errors()
    if isinstance(err, timeouts):
        return "agent_timeout"
    if isinstance(err, refusals):
        return "agent_refused"
    return "agent_error"


def wants_anthropic(fn) -> bool:
    """Whether the agent function's second parameter is `anthropic_client`."""
    parameters = list(inspect.signature(fn).parameters)
    return len(parameters) > 1 and parameters[1] == ANTHROPIC_PARAMETER


class AgentLoadError(ValueError):
    """agent.path / agent.function do not name an async function."""


def load_agent_function(path: str, name: str):
    try:
        fn = load_from_file(path, name, "agent.path")
    except FileNotFoundError as err:
        raise AgentLoadError(str(err)) from None
    if not inspect.iscoroutinefunction(fn):
        raise AgentLoadError(f"agent.function {name!r} in {path} must be an `async def episode(row, client)` (or "
                             f"`(row, {ANTHROPIC_PARAMETER})`)")
    if wants_anthropic(fn):
        if importlib.util.find_spec("anthropic") is None:  # checked before any episode runs
            raise AgentLoadError(f"agent.function {name!r} in {path} takes `{ANTHROPIC_PARAMETER}`: install the "
                                 f"`anthropic` package (pip install -e .[agents])")
    return fn


class OpenAIAgentRunner:
    def __init__(self, endpoint, episode_fn, tokenizer, budget, max_tokens: int, timeout_s: float,
                 per_turn: bool = False):
        self.endpoint, self.episode_fn, self.tokenizer, self.per_turn = endpoint, episode_fn, tokenizer, per_turn
        self.budget, self.max_tokens, self.timeout_s = budget, max_tokens, timeout_s
        self.env_errors: Counter = Counter()
        self.anthropic = wants_anthropic(episode_fn)

    async def start(self) -> None:
        """Serve the endpoint (before any episode runs)."""
        await self.endpoint.start()

    async def close(self) -> None:
        await self.endpoint.close()

    def metrics(self) -> dict:
        """Agent failures by reason, and the endpoint's refusals and tool-call errors."""
        return {**{f"rollout/env_errors/{reason}": float(count) for reason, count in sorted(self.env_errors.items())},
                **self.endpoint.metrics()}

    def client(self, key: str):
        """The official client the agent function asked for, pointed at the endpoint with the episode's key."""
        if self.anthropic:
            from anthropic import AsyncAnthropic

            return AsyncAnthropic(base_url=self.endpoint.url.removesuffix("/v1"), api_key=key, max_retries=0,
                                  timeout=self.timeout_s)
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.endpoint.url, api_key=key, max_retries=0, timeout=self.timeout_s)

    async def run(self, row, sampling) -> Episode:
        session = AgentSession(uuid.uuid4().hex, self.tokenizer, self.budget, self.max_tokens, per_turn=self.per_turn)
        self.endpoint.sessions[session.id] = session
        client = self.client(session.id)
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
