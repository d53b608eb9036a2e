"""A `verifiers` environment (prime-rl's, release 0.4, its v1 API), unmodified, as asyncrl's `agent.path`.

The environment is verifiers' own: the taskset in adder_v1.py (its reward is the rubric) and its tools in
adder_tools.py (a Toolset that verifiers serves over MCP), played by verifiers' built-in `null` harness (its chat
program: the official `openai` client, the MCP tools, the whole history sent back each turn) in the `subprocess`
runtime, one `SingleAgentEnv` episode per asyncrl episode. verifiers routes the program's model calls through its
interception server to the provider its client config names: here the episode's endpoint, with the episode's key
(verifiers reads a key from an environment variable, so each episode gets its own). The reward is the trace's.

    asyncrl run --config tools_cpu.yaml tools.builtins=[] agent.path=examples/verifiers/agent.py

What verifiers needs beside its package (docs/agents.md "Harnesses"): the `null` harness runs its chat program with
`uv` (the agents extra installs it beside this interpreter) in an environment of its own, which it builds on
first use from PyPI; the toolset runs as `python -m adder_tools` in a process of its own, so this folder goes on
PYTHONPATH. Each episode starts the tool server and the chat program anew: seconds, not milliseconds.
"""
import os
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
# verifiers imports a taskset by name and starts its tool server as `python -m adder_tools`: both need this folder
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if HERE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
# the `null` harness runs its chat program with `uv`, found on PATH: the one the agents extra installs beside this
# interpreter (else verifiers installs one with `pip install --user`)
BIN = os.path.dirname(sys.executable)
if BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join(p for p in (BIN, os.environ.get("PATH")) if p)

import verifiers.v1 as vf  # noqa: E402  (after the path above)
from adder_v1 import AdderData, AdderTask  # noqa: E402

MAX_TURNS = 3
"""Model turns per episode (`max_turns` in verifiers' agent config); the recipe's rollout.max_turns should be at least this."""

STANDARD_FINISH_REASONS = {"X-Asyncrl-Finish-Reason": "standard"}
"""verifiers checks each reply's finish_reason against OpenAI's own values: the endpoint answers a reply whose tool
calls the model all got wrong with "stop" instead of "malformed_tool_call" (still counted in rollout/tool_errors)."""

ENV_CONFIG = {"taskset": {"id": "adder_v1"},
              "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": MAX_TURNS}}
"""verifiers' run config for the env (what `--env.*` flags set): the null harness, run on this machine."""


class VerifiersEpisodeError(RuntimeError):
    """verifiers recorded the episode as failed (its harness, tool server or model call); asyncrl counts it."""


async def episode(row, client):
    """One verifiers episode of the row's task through the episode's endpoint; its trace's reward."""
    key_var = f"ASYNCRL_EPISODE_KEY_{uuid.uuid4().hex}"
    os.environ[key_var] = client.api_key
    try:
        env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig.model_validate(ENV_CONFIG))
        task = AdderTask(AdderData(idx=0, prompt=list(row["prompt"]), answer=row["ground_truth"]),
                         env.taskset.config.task)
        ctx = vf.ModelContext(model="asyncrl", client=vf.EvalClientConfig(
            base_url=str(client.base_url), api_key_var=key_var, headers=STANDARD_FINISH_REASONS))
        async with env.serving():
            result = await env.run_episode(task, ctx)
    finally:
        del os.environ[key_var]
    errors = [*result.errors, *(error for trace in result.traces for error in trace.errors)]
    if errors:  # verifiers keeps failures as data on the trace; asyncrl counts a raise (rollout/env_errors/...)
        raise VerifiersEpisodeError(f"{errors[0].type}: {errors[0].message[-500:]}")
    return sum(trace.reward for trace in result.traces)
