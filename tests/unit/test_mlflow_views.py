"""What a person sees of a run in MLflow: counters only when they change, the overview section that sorts first,
the dashboards drawn from a real sqlite store, and the tracking server's command and start-up errors."""
import os
import signal
import time

import pytest

from asyncrl.telemetry.counters import CounterFilter, counter_kind
from asyncrl.telemetry.mlflow_logger import MetricsLogger, is_local_store, resolve_tracking_uri
from asyncrl.telemetry.overview import OVERVIEW, SECTION, run_page_url, with_overview
from asyncrl.telemetry.plots import (PLOT_FILES, PlotPublisher, generator_keys, histogram_keys, staleness_histogram)
from asyncrl.telemetry.server import TrackingServerError, server_command, start_tracking_server

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module's tests (creating its schema takes seconds); each test makes its own run."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def test_counters_are_declared_by_kind_and_other_metrics_are_not_counters():
    assert counter_kind("buffer/dropped/stale") == "window"
    assert counter_kind("buffer/dropped_stale") == "window"
    assert counter_kind("buffer/dropped_total/stale") == "cumulative"
    assert counter_kind("generator/weight_failures") == "cumulative"
    assert counter_kind("learner/skipped_steps") == "cumulative"
    for key in ("reward/mean", "buffer/staleness/mean", "buffer/size", "timing/learner/idle_frac"):
        assert counter_kind(key) is None


def test_a_running_total_is_logged_when_it_changes_and_a_step_count_when_it_is_not_zero():
    kept = CounterFilter()
    reports = [{"reward/mean": 0.1, "learner/skipped_steps": 0.0, "buffer/dropped/stale": 0.0},
               {"reward/mean": 0.2, "learner/skipped_steps": 0.0, "buffer/dropped/stale": 3.0},
               {"reward/mean": 0.3, "learner/skipped_steps": 1.0, "buffer/dropped/stale": 3.0},
               {"reward/mean": 0.4, "learner/skipped_steps": 1.0, "buffer/dropped/stale": 0.0},
               {"reward/mean": 0.5, "learner/skipped_steps": 1.0, "buffer/dropped/stale": 0.0}]
    out = [kept.keep(report) for report in reports]
    assert [row["reward/mean"] for row in out] == [0.1, 0.2, 0.3, 0.4, 0.5]  # never filtered
    assert [row.get("learner/skipped_steps") for row in out] == [None, None, 1.0, None, None]
    # each non-zero step count, however often it repeats, and the one 0 that ends it
    assert [row.get("buffer/dropped/stale") for row in out] == [None, 3.0, 3.0, 0.0, None]


def test_the_overview_copies_the_first_charts_under_a_section_that_sorts_before_every_metric_prefix():
    report = {"reward/sampled_mean": 0.3, "reward/mean": 0.5, "buffer/staleness/mean": 1.0,
              "offpolicy/mismatch_k3": 0.01, "loss/pg": 0.2}
    out = with_overview(report)
    # the reward of every group sampled first, the trained groups' (dynamic sampling's survivors) named beside it
    assert out["RL overview/01 reward sampled"] == 0.3 and out["RL overview/02 reward trained groups"] == 0.5
    assert out["RL overview/04 staleness mean"] == 1.0
    assert out["RL overview/06 mismatch k3"] == 0.01 and out["loss/pg"] == 0.2 and out["reward/mean"] == 0.5
    assert not any("loss" in key for key in out if key.startswith(SECTION))
    names = [f"{SECTION}/{name}" for _, name in OVERVIEW]
    assert names == sorted(names)  # MLflow sorts the charts of a section by name: this is their order
    assert all(SECTION < key for key, _ in OVERVIEW)  # and the sections: upper case sorts before lower case
    assert run_page_url("http://h:5000/", "3", "abc") == (
        "http://h:5000/#/experiments/3/runs/abc/model-metrics?workflowType=machine_learning")


def test_the_logger_keeps_zero_counters_out_of_the_run_and_adds_the_overview(store, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("counters", artifact_location=str(tmp_path))).info.run_id
    logger = MetricsLogger(uri, run_id, overview=True)
    for step in range(3):
        logger.log({"reward/sampled_mean": 0.1 * step, "buffer/dropped/stale": float(step == 1),
                    "buffer/dropped_total/stale": float(step >= 1)}, step=step)
    logger.close()
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
               for key in ("reward/sampled_mean", "buffer/dropped/stale", "buffer/dropped_total/stale",
                           "RL overview/01 reward sampled")}
    assert [step for step, _ in history["reward/sampled_mean"]] == [0, 1, 2]
    assert history["buffer/dropped/stale"] == [(1, 1.0), (2, 0.0)]
    assert history["buffer/dropped_total/stale"] == [(1, 1.0)]
    assert [step for step, _ in history["RL overview/01 reward sampled"]] == [0, 1, 2]


def test_generator_series_and_staleness_bins_are_found_among_the_run_metrics():
    keys = ["gen-0/perf/generator/tokens_per_s", "gen-0/timing/generator/idle_frac", "perf/generator/tokens_per_s",
            "gen-1/timing/generator/idle_frac", "offpolicy/staleness/hist/10", "offpolicy/staleness/hist/2",
            "offpolicy/staleness/hist/0", "offpolicy/staleness/hist_x"]
    found = generator_keys(keys)
    assert set(found) == {"gen-0", "gen-1"}  # the learner's own fleet mean is not a generator
    assert found["gen-0"]["perf/generator/tokens_per_s"] == "gen-0/perf/generator/tokens_per_s"
    bins = histogram_keys(keys)
    assert bins == ["offpolicy/staleness/hist/0", "offpolicy/staleness/hist/2", "offpolicy/staleness/hist/10"]
    series = {bins[0]: ([1, 2], [1.0, 0.25]), bins[1]: ([2], [0.75])}
    assert staleness_histogram(series, bins) == ([1, 2], [[1.0, 0.0, 0.0], [0.25, 0.75, 0.0]])


def test_the_dashboards_are_drawn_from_the_run_and_logged_as_png_artifacts(store, tmp_path):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("plots", artifact_location=str(tmp_path / "art"))).info.run_id
    now = int(time.time() * 1000)
    points = []
    for step in range(1, 6):
        values = {"reward/mean": 0.1 * step, "buffer/staleness/mean": 0.5, "buffer/staleness/max": 1.0,
                  "offpolicy/mismatch_k3": 0.01, "offpolicy/staleness/hist/0": 0.5,
                  "offpolicy/staleness/hist/1": 0.5, "perf/learner/tokens_per_s": 100.0,
                  "timing/learner/idle_frac": 0.2, "gen-0/perf/generator/tokens_per_s": 50.0,
                  "gen-0/timing/generator/idle_frac": 0.4}
        points += [Metric(key, value, now, step) for key, value in values.items()]
    client.log_batch(run_id, metrics=points)
    ticks = iter([0.0, 0.0, 10.0, 10.0])  # construction, a step before it is due, then one after
    plots = PlotPublisher(uri, run_id, str(tmp_path / "job"), every_s=5.0, clock=lambda: next(ticks))
    plots.after_step()
    assert plots._thread is None  # not due yet
    plots.after_step()
    plots._thread.join(timeout=120)
    assert plots.refreshes == 1
    assert plots.refresh()  # the end-of-run refresh overwrites the same files
    listed = sorted(os.path.basename(item.path) for item in client.list_artifacts(run_id, "plots"))
    assert listed == sorted(PLOT_FILES)
    for name in PLOT_FILES:
        local = client.download_artifacts(run_id, f"plots/{name}", str(tmp_path / "down"))
        with open(local, "rb") as handle:
            assert handle.read(8) == PNG_MAGIC
        assert os.path.getsize(local) > 10_000  # drawn, not an empty canvas


def test_a_relative_sqlite_store_is_published_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"
    assert resolve_tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"
    assert resolve_tracking_uri("http://h:5000") == "http://h:5000"
    assert is_local_store(f"sqlite:///{tmp_path}/mlflow.db") and is_local_store("/some/mlruns")
    assert not is_local_store("http://h:5000")


def test_the_tracking_server_is_single_worker_and_allows_the_name_it_publishes():
    local = server_command("sqlite:////j/mlflow.db", "/j/mlartifacts", "127.0.0.1", 5123, "127.0.0.1")
    assert local[1:4] == ["-m", "mlflow", "server"] and "--allowed-hosts" not in local
    assert local[local.index("--workers") + 1] == "1" and local[local.index("--port") + 1] == "5123"
    public = server_command("sqlite:////j/mlflow.db", "/j/mlartifacts", "0.0.0.0", 5123, "learner.example")
    allowed = public[public.index("--allowed-hosts") + 1].split(",")
    assert "learner.example:5123" in allowed and "127.0.0.1:5123" in allowed and "10.*" in allowed


def process_tree(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            children = [int(child) for child in handle.read().split()]
    except OSError:
        return [pid]
    return [pid, *(grandchild for child in children for grandchild in process_tree(child))]


def test_the_tracking_server_runs_no_job_runner_beside_it(tmp_path):
    """MLflow's job execution (a job runner and Huey worker pools) is off: it would take the job's cores."""
    proc, url = start_tracking_server(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path), "127.0.0.1", 0,
                                      timeout_s=120, say=lambda _: None)
    try:
        time.sleep(2)  # MLflow starts its job runner right after the server answers
        commands = []
        for pid in process_tree(proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    commands.append(handle.read().replace(b"\0", b" ").decode())
            except OSError:
                pass
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert any("mlflow server" in command for command in commands), commands
    assert not [command for command in commands if "mlflow.server.jobs" in command or "huey" in command], commands


def test_a_tracking_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    with pytest.raises(TrackingServerError, match="exited"):
        start_tracking_server("notascheme://nowhere", str(tmp_path), "127.0.0.1", 0, timeout_s=120, say=lambda _: None)
    assert os.path.isfile(tmp_path / "mlflow-server.log")


def test_serve_with_a_server_uri_and_bad_settings_are_refused():
    from asyncrl.telemetry.config import TelemetryConfig

    with pytest.raises(ValueError, match="already a server"):
        TelemetryConfig(serve=True, tracking_uri="http://h:5000")
    with pytest.raises(ValueError, match=">= 0"):
        TelemetryConfig(plots_every_s=-1)
    with pytest.raises(ValueError, match="port"):
        TelemetryConfig(serve_port=70000)
