"""A suite task built end to end at a tiny size through the public path (its parquet, reward file, `asyncrl
init-model`, `asyncrl sft`, its recipe), built once (a second call reuses it), and its
recipe resolves for `asyncrl run --dry-run` with the task's own model, data, reward and held-out file."""
import os
import subprocess
import sys

import pytest

from asyncrl.bench.suite import sort_letters
from asyncrl.bench.suite.assets import MARKER

TINY = {"num_train": 16, "num_sft": 16, "num_test": 4, "sft_steps": 2, "hidden": 32, "layers": 2}


@pytest.mark.slow
def test_a_suite_task_builds_once_through_the_public_path_and_its_recipe_resolves(tmp_path):
    task = sort_letters.build(str(tmp_path), seed=0, **TINY)
    folder = os.path.dirname(task.recipe)
    marker = os.path.join(folder, MARKER)
    assert os.path.isfile(os.path.join(task.warm_start, "config.json")) and os.path.isfile(marker)
    assert task.name == "sort_letters" and task.test_files == (os.path.join(folder, "data", "test.parquet"),)
    built_at = os.stat(marker).st_mtime_ns
    assert sort_letters.build(str(tmp_path), seed=0, **TINY) == task  # cached: nothing rebuilt
    assert os.stat(marker).st_mtime_ns == built_at

    env = {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "ASYNCRL_"))}
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", "--config", task.recipe, "--dry-run",
                          *task.overrides], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**env, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    for value in (task.warm_start, os.path.join(folder, "reward.py"), task.test_files[0],
                  os.path.join(folder, "data", "train.parquet")):
        assert value in out.stdout, (value, out.stdout[-3000:])
