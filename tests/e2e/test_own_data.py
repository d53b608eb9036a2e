"""End to end: `asyncrl run` on the default recipe (demo.task=sort_digits) with the user's own model and data and
no eval.files. The recipe's demo is switched off and says so once; no demo asset is built; the recipe's evaluation
runs on nothing and says so once; and no metric of the run is named after the demo. The demo's model stands in for
the user's; the rows are the user's own data source, scored by the user's reward file."""
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import free_port
from tests.e2e.jobs import common_overrides, job_env, mlflow_metric_keys

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == str(ground_truth))
"""


@pytest.mark.slow
def test_a_job_with_its_own_model_and_data_runs_no_demo_machinery(tmp_path, demo_assets, demo_cache):
    model_dir, (train_file, *_) = demo_assets
    rows = pq.read_table(train_file).to_pylist()[:64]
    for row in rows:
        row["data_source"] = "my_task"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mine.parquet")
    (tmp_path / "reward.py").write_text(REWARD)
    job_dir = tmp_path / "job"
    overrides = [*common_overrides(tmp_path / "no-demo", free_port(), steps=2), f"model.path={model_dir}",
                 f"data.train_files=[{tmp_path / 'mine.parquet'}]", f"reward.path={tmp_path / 'reward.py'}",
                 "generator.engine=hf", "algo.dynamic_sampling=false",
                 "eval.every_steps=1", "eval.before_train=true"]  # asked for, with nothing to evaluate on
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", *overrides], cwd=tmp_path,
                          env={**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir)}, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("demo.task=sort_digits is off: this job brings its own model/data") == 1, out[-3000:]
    learner_log = (job_dir / "learner.log").read_text()
    assert learner_log.count("no evaluation while training: no eval.files and data.val_fraction=0") == 1
    assert "evaluation of v" not in learner_log
    assert not (tmp_path / "no-demo").exists()  # the demo's cache: nothing built
    summary = json.loads((job_dir / "summary.json").read_text())
    keys = mlflow_metric_keys(tmp_path, summary["mlflow_run_id"])
    assert "reward/mean" in keys and not [key for key in keys if "sort_digits" in key or "demo" in key], \
        sorted(key for key in keys if "sort_digits" in key or "demo" in key)
