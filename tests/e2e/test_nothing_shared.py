"""A generator that shares nothing with the learner but the buffer address and the recipe (issue: generators on
other hosts): started in an empty directory with an empty HOME and caches, told to take everything from the
learner (generator.model_source=learner), it gets the tokenizer and model config from the catch-up server, the
weights through weight sync, the prompts with its admissions, and trains the job. Both backends."""
import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import QUIET_TELEMETRY, job_env, read_progress, subset_parquet

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.mark.parametrize("backend", ["zmq", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_generator_with_an_empty_home_gets_everything_from_the_learner(demo_assets, tmp_path, backend, request):
    model_dir, files = demo_assets
    subset_parquet(files[0], str(tmp_path / "epoch.parquet"), 16)
    job_dir = tmp_path / "job"
    recipe = [f"model.path={model_dir}", "demo.task=''", f"data.train_files=[{tmp_path / 'epoch.parquet'}]",
              f"learner.total_steps={STEPS}", f"buffer.port={free_port()}", "buffer.groups_per_step=2",
              "rollout.n=2", "rollout.max_tokens=8", "algo.dynamic_sampling=false", "generator.engine=hf",
              "generator.max_inflight_groups=2", "learner.torch_threads=1", "buffer.done_grace_s=5",
              "telemetry.progress=false", *QUIET_TELEMETRY]
    if backend == "redis":
        recipe += ["buffer.backend=redis", f"buffer.redis.url={request.getfixturevalue('redis_server').url}",
                   f"buffer.redis.namespace=bare{uuid.uuid4().hex[:8]}"]
    learner_env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir), "PYTHONUNBUFFERED": "1"}
    learner = subprocess.Popen([sys.executable, "-m", "asyncrl.launch.cli", "learner", *recipe], cwd=tmp_path,
                               env=learner_env, stdout=open(tmp_path / "learner.log", "wb"), stderr=subprocess.STDOUT)
    bare = tmp_path / "elsewhere"  # the generator's host: nothing of the learner's, no caches
    home = bare / "home"
    home.mkdir(parents=True)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("HF_", "TRANSFORMERS_", "XDG_", "ASYNCRL_"))}
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", MLFLOW_TRACKING_URI="")
    try:
        generator = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "generator", *recipe,
                                    "generator.model_source=learner", "generator.generator_id=bare"],
                                   cwd=bare, env=env, capture_output=True, text=True, timeout=300)
        assert generator.returncode == 0, generator.stdout[-3000:] + generator.stderr[-3000:]
        assert learner.wait(timeout=120) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    finally:
        if learner.poll() is None:
            learner.kill()
    assert "model files and weights v0 from the learner" in generator.stdout + generator.stderr
    models = home / ".cache" / "asyncrl" / "models"
    [built] = os.listdir(models)
    assert built.endswith("-bare")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(models / built))
    assert any(name.startswith("tokenizer") for name in os.listdir(models / built))
    progress = read_progress(job_dir)
    assert len(progress) == STEPS
    trained = [json.loads(line) for line in open(job_dir / "trained_groups.jsonl")]
    assert sum(len(row["groups"]) for row in trained) == 2 * STEPS
