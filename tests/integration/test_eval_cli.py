"""`asyncrl eval` on the demo model (an HF directory) and a few of its prompts, with the hf engine and the
built-in scorer: a table per data source and one JSON line of metrics."""
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def test_asyncrl_eval_prints_a_table_and_the_metrics_of_a_model(tmp_path, demo_assets):
    model_dir, (train_file, *_) = demo_assets
    rows = pq.read_table(train_file).to_pylist()[:6]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "held_out.parquet")
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "eval", "--checkpoint", model_dir, "--files",
                           str(tmp_path / "held_out.parquet"), "generator.engine=hf", "eval.n=2",
                           "eval.k_values=[1,2]", "eval.temperature=1.0"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    metrics = json.loads(lines[-1])
    source = rows[0]["data_source"]
    assert metrics[f"eval/{source}/prompts"] == 6.0 and 0.0 <= metrics[f"eval/{source}/pass_at_1"] <= \
        metrics[f"eval/{source}/pass_at_2"] <= 1.0
    assert metrics[f"eval/{source}/mean_at_2"] == metrics[f"eval/{source}/mean_reward"]
    assert lines[-4].split()[0] == "data_source" and "pass_at_2" in lines[-4]  # header, the source, all, the JSON
    assert lines[-3].startswith(source) and lines[-2].startswith("all")
    assert "eval: on eval.files: held_out.parquet (6 prompts)" in proc.stdout  # the data the numbers are of


def test_asyncrl_eval_says_what_is_missing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "eval", "--checkpoint", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--files" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "eval", "--checkpoint", str(tmp_path / "nope"),
                           "--files", "x.parquet"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
