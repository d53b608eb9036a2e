"""The trackers beside MLflow (telemetry/trackers.py): TensorBoard, W&B offline and SwanLab offline each get the
learner's metrics under the same names, read back from the files each library wrote; a tracker that fails is
dropped and never stops MLflow or the others; telemetry.loggers is checked."""
import logging
import os
import sys

import pytest

from asyncrl.telemetry.config import TelemetryConfig
from asyncrl.telemetry.mlflow_logger import MetricsLogger
from asyncrl.telemetry.trackers import FAILURES_BEFORE_DROP, Trackers, open_job_trackers, require_packages
from tests.tracker_files import swanlab_run, tensorboard_run, wandb_run

REPORTS = [(1, {"reward/mean": 0.25, "RL overview/01 reward sampled": 0.5}),
           (2, {"reward/mean": 0.5, "RL overview/01 reward sampled": 0.75}),
           (3, {"reward/mean": 0.75, "loss/pg": -0.125})]
EVAL = (2, {"eval/all/mean_reward": 0.625})  # an evaluation lands after step 3, at the step it evaluated


def log_reports(trackers: Trackers) -> None:
    trackers.log_params({"algo.name": "grpo", "buffer.max_staleness": 1}, "algo:\n  name: grpo\n")
    for step, metrics in REPORTS:
        trackers.log(metrics, step)
    trackers.log(EVAL[1], EVAL[0])
    trackers.close("FINISHED")


def expected_points() -> dict:
    points: dict = {}
    for step, metrics in [*REPORTS, EVAL]:
        for key, value in metrics.items():
            points.setdefault(key, []).append((step, value))
    return points


def test_tensorboard_gets_every_point_under_the_same_names(tmp_path):
    trackers = Trackers.open(["mlflow", "tensorboard"], str(tmp_path), "job-1", "asyncrl")
    assert [t.name for t in trackers.trackers] == ["tensorboard"]
    log_reports(trackers)
    points, texts = tensorboard_run(str(tmp_path / "tensorboard" / "job-1"))
    assert points == expected_points()
    assert texts == ["config/resolved.yaml/text_summary"]  # the config, as text


def test_wandb_offline_gets_every_point_on_its_own_step_axis_and_the_params(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    trackers = Trackers.open(["mlflow", "wandb"], str(tmp_path), "job-1", "asyncrl-test")
    assert [t.name for t in trackers.trackers] == ["wandb"]
    log_reports(trackers)
    points, config, run, _ = wandb_run(str(tmp_path))
    assert points == expected_points()  # the evaluation at step 2 kept, after step 3
    assert run.project == "asyncrl-test" and run.display_name == "job-1"
    assert config["algo.name"] == '"grpo"' and config["buffer.max_staleness"] == "1"


def test_swanlab_offline_gets_every_point_and_never_reaches_its_cloud(tmp_path, monkeypatch):
    monkeypatch.delenv("SWANLAB_MODE", raising=False)  # no mode given: offline, not SwanLab's online default
    trackers = Trackers.open(["mlflow", "swanlab"], str(tmp_path), "job-1", "asyncrl-test")
    assert [t.name for t in trackers.trackers] == ["swanlab"]
    log_reports(trackers)
    points, start, finish, config = swanlab_run(str(tmp_path))
    assert points == expected_points()
    assert start.project == "asyncrl-test" and start.name == "job-1" and finish is not None
    assert "algo.name" in config and "grpo" in config


class Broken:
    name = "broken"

    def __init__(self):
        self.calls = 0
        self.closed = None

    def log(self, metrics, step):
        self.calls += 1
        raise OSError("disk full")

    def log_params(self, params, config_yaml):
        raise OSError("disk full")

    def close(self, status):
        self.closed = status


class Kept:
    name = "kept"

    def __init__(self):
        self.points = []
        self.closed = None

    def log(self, metrics, step):
        self.points.append((step, dict(metrics)))

    def log_params(self, params, config_yaml):
        pass

    def close(self, status):
        self.closed = status


def test_a_failing_tracker_is_dropped_and_mlflow_and_the_others_go_on(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("trackers", artifact_location=str(tmp_path))).info.run_id
    broken, kept = Broken(), Kept()
    trackers = Trackers([broken, kept])
    logger = MetricsLogger(uri, run_id, overview=True, trackers=trackers)
    with caplog.at_level(logging.WARNING, logger="asyncrl.telemetry.trackers"):
        trackers.log_params({"a": 1}, "a: 1\n")
        for step in range(6):
            logger.log({"reward/sampled_mean": 0.1 * step, "loss/pg": float("nan")}, step=step)
        logger.close()
    trackers.close("FINISHED")
    assert broken.calls == FAILURES_BEFORE_DROP - 1 and broken.closed == "FAILED"  # params failed once, then logs
    assert trackers.dropped == ["broken"] and "left out for the rest of the job" in caplog.text
    assert [step for step, _ in kept.points] == list(range(6)) and kept.closed == "FINISHED"
    # the same names MLflow gets, the overview included; what MLflow cannot store (NaN) is left out of both
    assert kept.points[1][1] == {"reward/sampled_mean": 0.1, "RL overview/01 reward sampled": 0.1}
    assert [m.step for m in client.get_metric_history(run_id, "reward/sampled_mean")] == list(range(6))


def test_a_tracker_that_cannot_start_is_left_out_with_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "wandb").write_text("a file where W&B's folder goes")
    with caplog.at_level(logging.WARNING, logger="asyncrl.telemetry.trackers"):
        trackers = Trackers.open(["mlflow", "wandb", "tensorboard"], str(tmp_path), "job", "asyncrl")
    assert [t.name for t in trackers.trackers] == ["tensorboard"]
    assert "wandb could not start" in caplog.text
    trackers.close("FINISHED")


def test_telemetry_loggers_are_checked_and_a_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    assert TelemetryConfig().loggers == ["mlflow"]
    for loggers, message in ((["mlflow", "neptune"], "unknown"), (["tensorboard"], "must start with mlflow"),
                             (["tensorboard", "mlflow"], "must start with mlflow"), ([], "must start with mlflow"),
                             (["mlflow", "wandb", "wandb"], "twice")):
        with pytest.raises(ValueError, match=message):
            TelemetryConfig(loggers=loggers)
    monkeypatch.setitem(sys.modules, "swanlab", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"asks for swanlab, which is not installed: pip install 'asyncrl\[trackers\]'"):
        require_packages(["mlflow", "tensorboard", "swanlab"])
    # the folder: telemetry.tracker_dir, else the job directory's trackers/
    opened = open_job_trackers(TelemetryConfig(loggers=["mlflow", "tensorboard"]), str(tmp_path), "job")
    opened.close("FINISHED")
    assert os.path.isdir(tmp_path / "trackers" / "tensorboard" / "job")


def test_every_nth_step_a_few_trained_groups_become_a_table_in_mlflow_and_the_other_trackers(tmp_path, monkeypatch):
    """RunRecord.log_step: at steps 2 and 4 (samples_every=2), the first 2 groups' samples, decoded, are appended to
    the run's samples/trained.json (MLflow's log_table) and logged as TensorBoard's and W&B's tables."""
    import json

    import numpy as np
    from mlflow.tracking import MlflowClient

    from asyncrl.telemetry.run_record import SAMPLE_COLUMNS, RunRecord
    from tests.groups import make_group

    monkeypatch.setenv("WANDB_MODE", "offline")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    telemetry = TelemetryConfig(tracking_uri=uri, progress=False, plots=False, system_metrics_every_s=0,
                                samples_every=2, samples_groups=2, loggers=["mlflow", "tensorboard", "wandb"])
    record = RunRecord(telemetry, "tables", str(tmp_path), total_steps=4,
                       decode=lambda ids: "".join(chr(ord("a") + i % 26) for i in ids) + "|\n")
    rng = np.random.default_rng(0)
    batches = {}
    for step in range(1, 5):
        batches[step] = [make_group(rng, n=2, version=step - 1) for _ in range(3)]
        record.log_step(step, batches[step], {"reward/mean": 0.5}, wait_s=0.0, staleness=[1, 0, 1])
    record.close("FINISHED")
    client = MlflowClient(uri)
    path = client.download_artifacts(record.run_id, "samples/trained.json", str(tmp_path / "down"))
    table = json.load(open(path))
    assert table["columns"] == list(SAMPLE_COLUMNS)
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [row["step"] for row in rows] == [2] * 4 + [4] * 4  # 2 groups of 2 samples, at steps 2 and 4
    first = batches[2][0].samples[0]
    assert rows[0]["completion"] == "".join(chr(ord("a") + i % 26) for i in first.completion_ids) + "|\n"
    assert rows[0]["reward"] == first.reward and rows[0]["version"] == 1 and rows[0]["staleness"] == 1
    assert rows[2]["staleness"] == 0 and rows[0]["finish_reason"] == "stop"
    _, texts = tensorboard_run(str(tmp_path / "trackers" / "tensorboard" / "tables"))
    assert "samples/trained/text_summary" in texts
    points, _, _, tables = wandb_run(str(tmp_path / "trackers"))
    assert points["reward/mean"] == [(1, 0.5), (2, 0.5), (3, 0.5), (4, 0.5)]
    assert tables == {"samples/trained": [(2, 4), (4, 4)]}
