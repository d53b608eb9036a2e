"""End to end: `asyncrl run` with the real vLLM engine, and a hand-started learner with generators that join
before and after it. Every process is a real subprocess; ports are free ports on 127.0.0.1."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import common_overrides, job_env, mlflow_metric_keys, read_progress

REQUIRED_METRICS = ("reward/mean", "loss/pg", "buffer/staleness/mean", "buffer/staleness/max",
                    "offpolicy/mismatch_k3", "perf/learner/tokens_per_s", "perf/generator/tokens_per_s",
                    "timing/weightsync/publish_s", "timing/learner/idle_frac", "gen-0/timing/generator/idle_frac",
                    "reward/sampled_mean", "gen-0/perf/generator/tokens_per_s", "RL overview/01 reward sampled",
                    "RL overview/11 generator idle frac", "system/learner/cpu_utilization_percentage",
                    "system/learner/system_memory_usage_megabytes", "system/gen-0/cpu_utilization_percentage")
"""Counters (buffer/dropped/*, generator/filtered_groups) reach MLflow only when they change: see
test_asyncrl_run_trains_logs_to_mlflow_and_respects_eta."""


VLLM_OVERRIDES = ["generator.engine=vllm", "learner.torch_threads=1"]
"""The demo recipe decodes with the hf engine; these tests run the real vLLM engine, whose CPU worker keeps a core."""


def inject_garbage(port):
    """Raw bad frames straight at the learner's buffer while it trains."""
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    from asyncrl.buffer.zmq.wire import pack

    for index, body in enumerate([b"\xc1\xc1garbage", b"\x00" * 32]):
        sock.send_multipart([pack({"op": "group", "req": index, "gen": "attacker"}), body])
    sock.send_multipart([b"not even msgpack"])
    for _ in range(3):
        sock.poll(10_000)
        sock.recv_multipart()
    sock.close(linger=0)
    context.term()


@pytest.mark.slow
@pytest.mark.vllm
def test_asyncrl_run_trains_logs_to_mlflow_and_respects_eta(tmp_path, demo_assets, demo_cache):
    """Also evaluates on the fleet while training: 6 held-out prompts at v0, v4 and v8, each logged at its step."""
    import pyarrow.parquet as pq

    from asyncrl.configs import load_config
    from asyncrl.launch.demo import heldout_file

    port = free_port()
    job_dir = tmp_path / "job"
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir), "WANDB_MODE": "offline"}
    overrides = common_overrides(demo_cache, port, steps=8)
    cfg = load_config(None, overrides)
    pq.write_table(pq.read_table(heldout_file(cfg.demo, cfg.job.seed)).slice(0, 6), tmp_path / "heldout.parquet")
    evaluation = [f"eval.files=[{tmp_path / 'heldout.parquet'}]", "eval.every_steps=4", "eval.before_train=true",
                  "eval.n=2", "eval.temperature=1.0", "eval.k_values=[1,2]"]
    # a tracking server on loopback; the plots and system metrics common_overrides turns off; the other trackers
    telemetry = ["telemetry.serve=true", "telemetry.plots=true", "telemetry.system_metrics_every_s=1",
                 "telemetry.loggers=[mlflow,tensorboard,wandb,swanlab]", "telemetry.samples_every=4"]
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.launch.cli", "run", *overrides, *VLLM_OVERRIDES,
                             *evaluation, *telemetry], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not (job_dir / "progress.jsonl").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    inject_garbage(port)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and "MLflow: run" in out
    # the reward of every group the policy sampled first, the trained groups' named beside it (buffer/sampled.py)
    assert out.index("reward of every group sampled: first") < out.index("reward of the trained groups: first")
    assert None not in (summary["sampled_reward_first"], summary["trained_reward_last"])
    assert summary["rejected"].get("malformed", 0) >= 2, summary["rejected"]
    progress = read_progress(job_dir)
    assert max(p["buffer/staleness/max"] for p in progress) <= 1
    assert all(0 <= p["timing/learner/idle_frac"] <= 1 for p in progress)
    check_the_run_in_mlflow(tmp_path, summary, progress, out)
    evals = summary["eval"]
    assert [row["step"] for row in evals] == [0, 4, 8], evals
    for row in evals:
        assert row["eval/all/prompts"] == 6 and 0 <= row["eval/asyncrl/sort_digits/pass_at_2"] <= 1
        assert row["eval/all/pass_at_1"] <= row["eval/all/pass_at_2"] and row["eval/lag_steps"] >= 0
    from mlflow.tracking import MlflowClient

    history = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(summary["mlflow_run_id"],
                                                                                 "eval/all/mean_reward")
    assert sorted(point.step for point in history) == [0, 4, 8]  # logged at the version asked for
    # every evaluation round's samples, with the text the generators sent back, as the run's samples/eval table
    artifacts = tmp_path / "mlartifacts" / summary["mlflow_experiment_id"] / summary["mlflow_run_id"] / "artifacts"
    table = json.loads((artifacts / "samples" / "eval.json").read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [row["version"] for row in rows] == [0] * 12 + [4] * 12 + [8] * 12  # 6 prompts x n = 2, per round
    assert all("sort:" in row["prompt"] and row["reward"] in (0.0, 1.0) for row in rows), rows[:3]
    assert sum(row["reward"] for row in rows if row["version"] == 8) / 12 == pytest.approx(
        evals[-1]["eval/all/mean_reward"])  # the table's rewards are the ones the round's metrics were made of
    check_the_other_trackers(job_dir / "trackers", cfg.job.name, progress)
    print("evaluation on the fleet:", [(row["step"], round(row["eval/all/mean_reward"], 3), row["eval/lag_steps"])
                                       for row in evals])


def check_the_other_trackers(folder, run_name: str, progress: list) -> None:
    """TensorBoard, W&B (offline) and SwanLab (offline) each hold every step's reward and the overview under
    MLflow's names, and the evaluations at the steps they evaluated (telemetry.loggers)."""
    from tests.tracker_files import swanlab_run, tensorboard_run, wandb_run

    rewards = [(row["step"], row["reward/mean"]) for row in progress]
    tensorboard, _ = tensorboard_run(str(folder / "tensorboard" / run_name))
    wandb_points, wandb_config, _, wandb_tables = wandb_run(str(folder))
    swanlab_points, _, finish, _ = swanlab_run(str(folder))
    assert finish is not None and wandb_config["algo.advantage"] == '"grpo"'
    for name, points in (("tensorboard", tensorboard), ("wandb", wandb_points), ("swanlab", swanlab_points)):
        assert [(step, pytest.approx(value)) for step, value in points["reward/mean"]] == rewards, name
        assert len(points["RL overview/01 reward sampled"]) == len(rewards), name
        assert [step for step, _ in points["eval/all/mean_reward"]] == [0, 4, 8], name
    assert [step for step, _ in wandb_tables["samples/trained"]] == [4, 8]  # the trained groups' table


def check_the_run_in_mlflow(tmp_path, summary, progress, out):
    """The run read back through MLflow's API, after `asyncrl run` served the store over HTTP (telemetry.serve):
    the learner published the server's address, and the generator logged through it under its prefix; system
    metrics of both processes; counters only when they changed; the dashboards as valid PNG artifacts."""
    from matplotlib.image import imread

    from asyncrl.telemetry.counters import counter_kind
    from asyncrl.telemetry.plots import PLOT_FILES

    assert summary["mlflow_tracking_uri"].startswith("http://127.0.0.1:"), summary["mlflow_tracking_uri"]
    assert "charts: http://127.0.0.1:" in out and "workflowType=machine_learning" in out, out
    keys = mlflow_metric_keys(tmp_path, summary["mlflow_run_id"])
    assert keys >= set(REQUIRED_METRICS), sorted(set(REQUIRED_METRICS) - keys)
    always_zero = {key for key in progress[0] if counter_kind(key) and all(row.get(key) == 0 for row in progress)}
    assert "buffer/dropped/poisoned_step" in always_zero and not always_zero & keys, always_zero & keys
    changed = {key for key in progress[0] if counter_kind(key) and key not in always_zero}
    assert changed <= keys, changed - keys
    plots = tmp_path / "mlartifacts" / summary["mlflow_experiment_id"] / summary["mlflow_run_id"] / "artifacts" / "plots"
    for name in PLOT_FILES:
        image = imread(plots / name)  # decodes the whole PNG
        assert image.shape[0] > 200 and image.shape[1] > 400, (name, image.shape)
    # a few trained groups every telemetry.samples_every steps, decoded, as a table of the run (MLflow's log_table)
    table = json.loads((plots.parent / "samples" / "trained.json").read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert sorted({row["step"] for row in rows}) == [4, 8] and all("sort:" in row["prompt"] for row in rows)
    assert all(0 <= row["reward"] <= 1 and row["staleness"] in (0, 1) for row in rows), rows


def start(role, overrides, tmp_path, job_dir, log_name):
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir)}
    log = open(tmp_path / log_name, "w")
    return subprocess.Popen([sys.executable, "-m", "asyncrl.launch.cli", role, *overrides], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_generators_started_before_and_after_the_learner_join_with_current_weights(tmp_path, demo_assets,
                                                                                    demo_cache):
    port = free_port()
    job_dir = tmp_path / "job"
    # 140 steps leave the late joiner runway before the job ends: it is started once 2 steps are done, says hello
    # at once, then loads its model for 30-40 s on the busy 2-core machine, while a step takes about 0.6 s (with
    # 48 steps the job ended first; with 100 it sent its first group at v84). Every group is trained (no dynamic
    # sampling): a weak warm start's groups are mostly all-wrong, and filtering them made the job's length,
    # and this test's, depend on how weak it came out (285 s in one run, 120 s in another)
    overrides = common_overrides(demo_cache, port, steps=140) + ["generator.engine=hf", "algo.dynamic_sampling=false"]
    procs = {"early": start("generator", overrides + ["generator.generator_id=early"], tmp_path, job_dir, "early.log")}
    deadline = time.time() + 120
    while "waiting for the learner" not in (tmp_path / "early.log").read_text():  # it is up, and no learner is
        assert procs["early"].poll() is None and time.time() < deadline, (tmp_path / "early.log").read_text()
        time.sleep(0.1)
    procs["learner"] = start("learner", overrides, tmp_path, job_dir, "learner.log")
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if (job_dir / "progress.jsonl").exists() and len(read_progress(job_dir)) >= 2:
                break
            assert procs["learner"].poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
            time.sleep(0.3)
        procs["late"] = start("generator", overrides + ["generator.generator_id=late"], tmp_path, job_dir, "late.log")
        for name in ("learner", "early", "late"):
            assert procs[name].wait(timeout=240) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    summary = json.loads((job_dir / "summary.json").read_text())
    late = summary["generators"]["late"]
    assert late["hello_version"] >= 2
    assert late["first_group_min_version"] >= late["hello_version"]  # it sampled only with weights it joined on
    assert "first_group_min_version" in summary["generators"]["early"]
    assert max(p["buffer/staleness/max"] for p in read_progress(job_dir)) <= 1


@pytest.mark.slow
@pytest.mark.vllm
def test_asyncrl_run_with_a_two_rank_ulysses_learner_publishes_whole_weights(tmp_path, demo_assets, demo_cache):
    """Two learner ranks (FSDP2 × Ulysses, packed) behind torchrun, one vLLM generator: the weights the generator
    samples with are the gathered full weights, so its logprobs agree with the learner's (k3 stays small), and
    the job checkpoints its last version."""
    port = free_port()
    job_dir = tmp_path / "job"
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir)}
    overrides = common_overrides(demo_cache, port, steps=6) + VLLM_OVERRIDES + [
        "learner.sp_size=2", "learner.packing=true", "learner.checkpoint_every=3"]
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", "--nproc", "2", *overrides],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    progress = read_progress(job_dir)
    worst = max(p["offpolicy/mismatch_k3"] for p in progress)
    assert worst < 0.05, [p["offpolicy/mismatch_k3"] for p in progress]
    assert sorted(os.listdir(job_dir / "checkpoints")) == ["step-00000003", "step-00000006"]
