"""End to end: agent harnesses people already use, unmodified, as `agent.path` (examples/): the OpenAI Agents SDK,
a LangGraph ReAct graph, an agent written against the `anthropic` client (through the endpoint's /v1/messages) and
a verifiers environment, each run for a few steps of the tool demo (configs/tools_cpu.yaml, its builtin tool swapped
for the harness's own tools) against the generator's endpoint: its episodes reach the learner, which trains on them,
and no request is refused (a history the harness rewrote would be: rollout/http_refusals/history_edited) nor does
any episode fail. The demo's assets are built once for the module, with a few SFT steps only: the model need not
call tools well here (tool calls round-tripping through each harness, with a scripted model:
tests/integration/test_harnesses.py)."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import QUIET_TELEMETRY, job_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = ["demo.sft_steps=5", "demo.sft_batch_size=16", "demo.num_prompts=64"]
HARNESSES = {"openai_agents_sdk": "agents", "langgraph": "langgraph", "anthropic_client": "anthropic",
             "verifiers": "verifiers.v1"}
"""Example folder -> the module the harness is imported as (skipped where it is not installed)."""
SMALLER = {"verifiers": ["learner.total_steps=1", "buffer.groups_per_step=1", "rollout.n=2",
                         "generator.max_inflight_groups=1", "agent.timeout_s=120"]}
"""Per-example overrides after the common ones: a verifiers episode starts its tool server and its harness's chat
program anew (seconds each), so its job trains one step on one group of 2 episodes."""
@pytest.fixture(scope="module")
def tool_demo_cache(tmp_path_factory):
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import prepare_demo

    cache = str(tmp_path_factory.mktemp("tool-demo"))
    cfg = load_config("tools_cpu.yaml", [f"demo.cache_dir={cache}", *DEMO])
    prepare_demo(cfg.demo, cfg.job.seed, say=lambda message: None)
    return cache


def metric_history(tmp_path, run_id, key) -> list:
    return [p.value for p in mlflow_client(tmp_path).get_metric_history(run_id, key)]


def mlflow_client(tmp_path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(HARNESSES))
def test_an_unmodified_harness_trains_through_the_endpoint(example, tool_demo_cache, tmp_path):
    pytest.importorskip(HARNESSES[example])
    job_dir = tmp_path / "job"
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir)}
    overrides = [f"demo.cache_dir={tool_demo_cache}", *DEMO, f"buffer.port={free_port()}", "tools.builtins=[]",
                 f"agent.path={ROOT}/examples/{example}/agent.py", "agent.timeout_s=60", "learner.total_steps=2",
                 "buffer.groups_per_step=2", "rollout.n=4", "generator.max_inflight_groups=2",
                 "generator.log_every_s=1", "algo.dynamic_sampling=false", *QUIET_TELEMETRY, *SMALLER.get(example, [])]
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", "--config", "tools_cpu.yaml", *overrides],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    print(f"{example}: job ran {time.monotonic() - started:.1f} s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((job_dir / "summary.json").read_text())
    steps = 1 if "learner.total_steps=1" in SMALLER.get(example, []) else 2
    assert summary["steps"] == steps  # the episodes reached the learner, which trained on them
    run_id = summary["mlflow_run_id"]
    assert metric_history(tmp_path, run_id, "gen-0/rollout/turns/mean")  # the episodes' metrics reached MLflow

    keys = set(mlflow_client(tmp_path).get_run(run_id).data.metrics)
    failures = {key.removeprefix("gen-0/") for key in keys if "http_refusals" in key or "env_errors" in key}
    assert not failures, sorted(failures)  # nothing refused, no episode failed
