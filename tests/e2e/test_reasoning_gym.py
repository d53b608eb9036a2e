"""End to end: `asyncrl run` on prompts that reasoning-gym generates (data.source=reasoning_gym), scored by its own
verifier, with the reward summed from two named functions (reward.functions) whose components reach MLflow."""
import json
import subprocess
import sys

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import common_overrides, job_env, mlflow_metric_keys

LENGTH_REWARD = '''
def short(data_source, solution_str, ground_truth, extra_info=None):
    return -len(solution_str) / 100.0
'''


@pytest.mark.slow
def test_a_job_trains_on_reasoning_gym_tasks_with_named_reward_components(tmp_path, demo_assets, demo_cache):
    pytest.importorskip("reasoning_gym")
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    job_dir = tmp_path / "job"
    model_dir, _ = demo_assets  # data of its own turns the demo off (demo_active): the model is named
    overrides = [*common_overrides(demo_cache, free_port(), steps=3), "generator.engine=hf", f"model.path={model_dir}",
                 "data.source=reasoning_gym", "data.reasoning_gym_tasks=[basic_arithmetic]",
                 "data.reasoning_gym_size=64", "data.max_prompt_tokens=48",
                 f"reward.functions=[{{name: correct, weight: 1.0}}, {{name: length, weight: 0.5, "
                 f"path: {tmp_path / 'length_reward.py'}, function: short}}]"]
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", *overrides], cwd=tmp_path,
                          env={**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    keys = mlflow_metric_keys(tmp_path, summary["mlflow_run_id"])
    assert {"reward/correct/mean", "reward/length/mean"} <= keys, sorted(k for k in keys if k.startswith("reward"))
    trained = [json.loads(line) for line in (job_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert len(trained) == 3 and all(len(step["groups"]) == 4 for step in trained)
