"""End to end: the agent recipe (configs/agent_cpu.yaml) as shipped, for a few steps and a short warm start, run
from the repository root as its docs say (agent.path is relative to it): the agent (examples/agent/agent.py, a
plain `openai` chat-completions loop with two tools) drives the episodes through the generator's endpoint, its
episodes reach the learner, which trains on them, the model writes tool calls in them, and no request is refused
nor episode failed. (That the reward rises: bench/agent_recipe.py, docs/benchmarks.md.)"""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import QUIET_TELEMETRY, job_env, read_progress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_the_agent_recipe_trains_on_episodes_with_tool_calls(tmp_path):
    job_dir = tmp_path / "job"
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir)}
    overrides = [f"demo.cache_dir={tmp_path / 'demo'}", "demo.sft_steps=40", "demo.sft_batch_size=32",
                 "demo.num_prompts=128", f"buffer.port={free_port()}", "learner.total_steps=3",
                 "buffer.groups_per_step=2", "rollout.n=4", "generator.max_inflight_groups=2",
                 "generator.log_every_s=1", "algo.dynamic_sampling=false", *QUIET_TELEMETRY]
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", "--config", "agent_cpu.yaml", *overrides],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    print(f"agent recipe: job ran {time.monotonic() - started:.1f} s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 3  # the agent's episodes reached the learner, which trained on them
    assert all(p["loss/pg"] == p["loss/pg"] for p in read_progress(job_dir))  # finite, not NaN
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = summary["mlflow_run_id"]
    # half the SFT transcripts open with a call, so the model writes calls in some of the 24+ episodes: after 40 SFT
    # steps some are well formed (the agent ran them: tool_use_frac) and some not (counted: tool_errors); how each
    # round-trips is tests/integration/test_agent_recipe.py's
    keys = set(client.get_run(run_id).data.metrics)
    used = max(p.value for p in client.get_metric_history(run_id, "gen-0/rollout/tool_use_frac"))
    assert used > 0 or any(key.startswith("gen-0/rollout/tool_errors/") for key in keys), sorted(keys)
    assert not [key for key in keys if "http_refusals" in key or "env_errors" in key], sorted(keys)
