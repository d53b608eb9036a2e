"""`asyncrl ray` on a real two-node Ray cluster on this machine (tests/ray_cluster.py): the learner's two ranks (gloo,
their rendezvous from rank 0's actor) are placed together on the head (learner_host), the generators on the other
node (generator_host); a generator's process killed with SIGKILL is restarted by Ray and delivers again (while
`asyncrl ray scale` takes the fleet from 1 to 2 generators: both start together, which keeps the test short), and
the fleet goes back to 1 while it trains; with data.epochs=1 every prompt is trained exactly once across all of
that; telemetry.serve's MLflow server runs on rank 0's node. Also: the autoscaler and Ctrl-C, and the launchers'
bench on a tiny setting."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import QUIET_TELEMETRY, alive, mlflow_metric_keys, effective_prompts, job_env, read_progress, subset_parquet
from tests.ray_cluster import start_cluster, stop_cluster, stop_process

pytest.importorskip("ray", reason="the ray extra (pip install 'asyncrl[ray]') is not installed")
pytestmark = pytest.mark.slow

PROMPTS = 240
GROUPS_PER_STEP = 4
JOB = "rayjob"


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = start_cluster()
    yield cluster
    stop_cluster(cluster)


def started_lines(log_path) -> list:
    """The `--- NAME started by Ray actor pid P on node N` lines of a RoleProcess log (launch/ray_actors.py)."""
    if not os.path.exists(log_path):
        return []
    return re.findall(r"--- \S+ started by Ray actor pid (\d+) on node (\w+)", open(log_path, errors="replace").read())


def delivered_after(log_path, marker_count: int) -> bool:
    """The generator's process number `marker_count` (1-based) logged its first accepted group."""
    text = open(log_path, errors="replace").read()
    lives = re.split(r"--- \S+ started by Ray actor", text)[1:]
    return len(lives) >= marker_count and "its first group was accepted" in lives[marker_count - 1]


def child_of(actor_pid: int) -> int:
    """The `asyncrl generator` process under a generator's actor."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        if ppid == actor_pid and b"asyncrl.launch.cli\x00generator" in cmdline:
            return int(entry)
    return 0


def wait_for(condition, driver, log_path, what: str, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert driver.poll() is None, f"the driver exited while waiting for {what}:\n" + open(log_path).read()[-4000:]
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n" + open(log_path).read()[-4000:]
        time.sleep(0.3)


def scale(cluster, count: int, env) -> str:
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "ray", "scale", JOB, "--generators",
                          str(count), "--address", cluster.address], capture_output=True, text=True, env=env,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def job_overrides(model_dir, tmp_path, job: str) -> list:
    return [f"model.path={model_dir}", "demo.task=''", f"data.train_files=[{tmp_path / 'epoch.parquet'}]",
            "data.epochs=1", "learner.total_steps=100", f"buffer.port={free_port()}", "buffer.max_staleness=1",
            f"buffer.groups_per_step={GROUPS_PER_STEP}", "rollout.n=2", "rollout.max_tokens=16",
            "algo.dynamic_sampling=false", "generator.engine=hf", "generator.max_inflight_groups=2",
            "generator.log_every_s=1", "learner.torch_threads=1", "buffer.done_grace_s=30",
            "buffer.request_timeout_s=5", f"job.name={job}", *QUIET_TELEMETRY]


def start_driver(cluster, tmp_path, job_dir, extra: list, overrides: list):
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir), "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    log_path = tmp_path / "driver.log"
    driver = subprocess.Popen([sys.executable, "-m", "asyncrl.launch.cli", "ray", "--address", cluster.address,
                               "--learner-resources", '{"learner_host": 1}', "--generator-resources",
                               '{"generator_host": 1}', *extra, *overrides],
                              cwd=tmp_path, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    return driver, log_path, env


def stop_driver(driver) -> None:
    stop_process(driver, signal.SIGINT)


def test_a_ray_job_places_restarts_scales_and_trains_each_prompt_once(ray_cluster, demo_assets, tmp_path):
    model_dir, files = demo_assets
    expected = subset_parquet(files[0], str(tmp_path / "epoch.parquet"), PROMPTS)
    job_dir = tmp_path / "job"
    began = time.monotonic()
    driver, log_path, env = start_driver(ray_cluster, tmp_path, job_dir, ["--generators", "1", "--nproc", "2"],
                                         [*job_overrides(model_dir, tmp_path, JOB), "telemetry.serve=true"])
    timings = {}
    try:
        steps = lambda: len(read_progress(job_dir)) if (job_dir / "progress.jsonl").exists() else 0  # noqa: E731
        wait_for(lambda: steps() >= 1, driver, log_path, "first step")
        timings["first step"] = time.monotonic() - began
        (_, learner_node), (_, other_rank_node) = started_lines(job_dir / "learner-0.log") + started_lines(
            job_dir / "learner-1.log")
        assert other_rank_node == learner_node  # the placement group keeps the ranks together
        (gen_pid, gen_node), = started_lines(job_dir / "gen-0.log")
        assert gen_node != learner_node  # the learner on the head, the generator on the other node
        wait_for(lambda: delivered_after(job_dir / "gen-0.log", 1), driver, log_path, "gen-0's first group")

        # the fleet grows to 2 while gen-0 is killed: gen-1 starts as Ray restarts gen-0 (both load an engine)
        assert "1 -> 2 generators; started gen-1" in scale(ray_cluster, 2, env)
        os.kill(child_of(int(gen_pid)), signal.SIGKILL)  # the generator's process, under its actor
        killed = time.monotonic()
        wait_for(lambda: len(started_lines(job_dir / "gen-0.log")) == 2, driver, log_path, "gen-0's restart")
        assert started_lines(job_dir / "gen-0.log")[1][1] == gen_node
        wait_for(lambda: delivered_after(job_dir / "gen-0.log", 2), driver, log_path, "gen-0 delivering again")
        timings["killed generator delivers again"] = time.monotonic() - killed
        wait_for(lambda: delivered_after(job_dir / "gen-1.log", 1), driver, log_path, "gen-1's first group")
        assert started_lines(job_dir / "gen-1.log")[0][1] == gen_node
        at_scale_down = steps()
        assert "2 -> 1 generators; stopping gen-1" in scale(ray_cluster, 1, env)
        assert at_scale_down < PROMPTS // GROUPS_PER_STEP, "the job ended before the fleet shrank: more prompts"

        assert driver.wait(timeout=300) == 0, open(log_path).read()[-4000:]
        timings["end"] = time.monotonic() - began
    finally:
        stop_driver(driver)
    log = open(log_path).read()
    assert "gen-0 restarted by Ray" in log and "stopped gen-1 (their dealt prompts go back)" in log, log[-4000:]
    timeline = effective_prompts(job_dir / "trained_groups.jsonl")
    trained = [prompt for step in sorted(timeline) for prompt in timeline[step]]
    assert sorted(trained) == sorted(expected), (len(trained), len(set(trained)))  # each once, none left out
    last = read_progress(job_dir)[-1]
    assert last["data/epoch"] == pytest.approx(1.0) and last["data/consumed"] == PROMPTS
    summary = json.loads((job_dir / "summary.json").read_text())
    assert {"gen-0", "gen-1"} <= set(summary["generators"])
    # telemetry.serve: an MLflow server on rank 0's node served the job's store to every process, and is gone
    assert summary["mlflow_tracking_uri"].startswith("http://"), summary["mlflow_tracking_uri"]
    assert any(key.startswith("gen-0/") for key in mlflow_metric_keys(tmp_path, summary["mlflow_run_id"]))
    assert "MLflow tracking server at http://" in log
    print(f"ray job: {len(trained)} prompts over {len(timeline)} steps; "
          + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in timings.items())
          + f"; returned {({k: v for k, v in last.items() if k.startswith('data/returned/')})}")


def test_the_autoscaler_grows_a_fleet_whose_learner_waits_and_ctrl_c_stops_the_job(ray_cluster, demo_assets, tmp_path):
    """One generator cannot keep this learner busy (it waits for a third of each step and more): `--autoscale 1:2`
    adds the second within a few steps; once it delivers, Ctrl-C stops the job: the driver exits 130 and no
    process of the job is left."""
    model_dir, files = demo_assets
    subset_parquet(files[0], str(tmp_path / "epoch.parquet"), 200)
    job_dir = tmp_path / "job"
    # an hour's job at this speed: it cannot end before the test stops it (CI's loaded cores took a minute to
    # start the second generator, while the learner trained 5 epochs)
    overrides = [*job_overrides(model_dir, tmp_path, "autoscaled"), "data.epochs=50", "learner.total_steps=10000"]
    driver, log_path, _ = start_driver(ray_cluster, tmp_path, job_dir,
                                       ["--generators", "1", "--autoscale", "1:2", "--autoscale-interval-s", "1",
                                        "--autoscale-cooldown-s", "5"], overrides)
    try:
        wait_for(lambda: (job_dir / "gen-1.log").exists() and delivered_after(job_dir / "gen-1.log", 1), driver,
                 log_path, "the autoscaler's second generator delivering")
        children = [child_of(int(pid)) for pid, _ in started_lines(job_dir / "gen-0.log")[-1:] +
                    started_lines(job_dir / "gen-1.log")]
        driver.send_signal(signal.SIGINT)
        assert driver.wait(timeout=120) == 130, open(log_path).read()[-4000:]
    finally:
        stop_driver(driver)
    log = open(log_path).read()
    decision = re.search(r"fleet: 1 -> 2 generators \(autoscale: (grow 1 -> 2 generators .*)\); started gen-1", log)
    assert decision, log[-4000:]
    assert "learner waited" in decision.group(1)
    assert all(pid and not alive(pid) for pid in children), children
    recorded = [json.loads(line) for line in open(job_dir / "autoscale.jsonl")]
    assert recorded[0]["from"] == 1 and recorded[0]["to"] == 2 and recorded[0]["autoscale/learner_idle_frac"] > 0.1
    print(f"autoscale decision: {decision.group(1)}")


def test_the_launchers_bench_times_run_and_ray_on_a_tiny_setting(ray_cluster, demo_cache, tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.launchers", "--ray-address", ray_cluster.address,
                          "--launchers", "ray", "--steps", "1", "--demo-cache", demo_cache, "--out",
                          str(tmp_path / "jobs")],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["medians"]) == {"ray"}  # one job: `asyncrl run`'s path is the suite's everywhere else
    assert all(0 < m["first_step_s"] <= m["end_s"] for m in result["medians"].values())
    assert "| asyncrl ray |" in out.stdout
