"""What a user with a task of their own does, through the public path only: the README's "Your own task" commands,
run as written in a copy of examples/reverse/ (their own rows, reward file and recipe inheriting demo_cpu.yaml,
`asyncrl init-model`, `asyncrl sft`, `asyncrl run`), each shrunk by a few overrides appended to it. The job must
train, evaluate on the task's held-out file and name it, and never touch the demo: no demo asset built, no
`demo`/`sort_digits` name in its metrics."""
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHRINK = {
    "init-model": ["--hidden", "32", "--layers", "2"],
    "sft": ["sft.steps=4", "sft.batch_size=16"],
    "run": ["learner.total_steps=4", "eval.every_steps=4", "buffer.groups_per_step=2", "rollout.n=4",
            "generator.max_inflight_groups=4", "telemetry.plots=false", "telemetry.system_metrics_every_s=0",
            "algo.dynamic_sampling=false"],  # 4 SFT steps teach nothing: most groups would be all-zero
}
"""Appended to each README command: the same job, a few steps long."""


def readme_commands() -> list:
    """The shell lines of the first bash block of the README's "Your own task" section."""
    with open(os.path.join(ROOT, "README.md")) as handle:
        text = handle.read()
    section = text.split("\n## Your own task\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_own_task_commands_train_and_evaluate_on_the_tasks_own_data(tmp_path):
    commands = readme_commands()
    assert commands[0] == "cd examples/reverse", commands
    work = tmp_path / "reverse"
    shutil.copytree(os.path.join(ROOT, "examples", "reverse"), work)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "ASYNCRL_"))}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    no_demo = tmp_path / "demo-cache"
    outputs, started = {}, time.monotonic()
    for line in commands[1:]:
        argv = shlex.split(line)
        if argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        else:
            assert argv[0] == "asyncrl", line
            command = argv[1]
            extra = SHRINK[command] + ([f"demo.cache_dir={no_demo}"] if command == "sft" else [])
            extra += [f"buffer.port={free_port()}"] if command == "run" else []
            argv = [sys.executable, "-m", "asyncrl.launch.cli", *argv[1:], *extra]
        out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{line}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        outputs[argv[3] if argv[1] == "-m" else "python"] = out
    print(f"README own-task commands: {time.monotonic() - started:.0f} s")  # shown with -s
    for name, out in outputs.items():  # launch/cli.py quiet_third_party: nothing a user cannot act on
        for noise in ("Setting accelerator", "Loading weights", "Writing model shards", "mlflow.store"):
            assert noise not in out.stdout + out.stderr, (name, noise, out.stderr[-2000:])
    assert not no_demo.exists(), "asyncrl sft built demo assets for a job that brings its own model and data"
    run = outputs["run"]
    assert re.search(r"^step \d+/4 \| reward [\d.]+ sampled, [\d.]+ trained", run.stderr + run.stdout, re.M), run
    assert re.search(r"^reward of every group sampled: first", run.stdout, re.M), run.stdout
    job_dir = run.stderr.split("job directory ", 1)[1].split()[0]
    with open(os.path.join(job_dir, "learner.log")) as handle:
        learner_log = handle.read()
    evaluations = [line for line in learner_log.splitlines() if "evaluation of v" in line]
    assert evaluations and all("test.parquet" in line for line in evaluations), evaluations

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    runs = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    assert len(runs) == 2  # the SFT job and the RL job
    keys = set().union(*(run_.data.metrics for run_ in runs))
    assert any(key.startswith("eval/reverse/") for key in keys), sorted(keys)
    assert not [key for key in keys if "demo" in key or "sort_digits" in key], sorted(keys)
    assert "sort_digits" not in learner_log and "demo:" not in learner_log
