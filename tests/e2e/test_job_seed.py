"""`job.seed` seeds the whole job: `asyncrl run` twice with the same job.seed trains the same first steps (the
learner's loss and the sampled reward of each step, bit for bit), and with another job.seed other ones. Only job.seed
is set: learner.seed, generator.seed and data.seed are left to follow it (configs/sections.py::part_seed).

Deterministic settings: one generator sampling one group at a time (generator.max_inflight_groups=1) on the hf
engine, staleness 0 (every group of step k is sampled by v(k-1)), every group trained (no dynamic sampling), one
torch thread on each side; the prompts are the user's own file (the demo's rows) and the demo's model, so changing
job.seed does not rebuild the demo (its cache key has the seed). The prompts are dealt in file order
(data.shuffle=false), so what another job.seed changes is the sampling: the test fails if generator.seed stays 0
whatever job.seed says (as it did). The reward is the completion's length, so every group has a loss to compare.
"""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import common_overrides, job_env, read_progress

STEPS = 2
LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 10
"""


def run_job(tmp_path, name, model_dir, train_file, demo_cache, seed) -> tuple:
    """(step, loss, sampled reward) of each step, and (prompts, completion lengths) of each step's groups."""
    job_dir = tmp_path / name
    reward_file = tmp_path / f"length_reward_{name}.py"
    reward_file.write_text(LENGTH_REWARD)
    overrides = [*common_overrides(demo_cache, free_port(), steps=STEPS, eta=0), f"model.path={model_dir}",
                 f"data.train_files=[{train_file}]", f"job.seed={seed}", "generator.engine=hf",
                 "generator.max_inflight_groups=1", "algo.dynamic_sampling=false", "buffer.groups_per_step=2",
                 "learner.torch_threads=1", "generator.torch_threads=1", "data.shuffle=false",
                 f"reward.path={reward_file}"]
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", *overrides], cwd=tmp_path,
                          env={**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir),
                               "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow-{name}.db"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = [json.loads(line) for line in (job_dir / "trained_groups.jsonl").read_text().splitlines()]
    return ([(row["step"], row["loss/pg"], row["reward/mean"]) for row in read_progress(job_dir)],
            [(step["prompts"], step["lengths"]) for step in trained])


@pytest.mark.slow
def test_the_same_job_seed_trains_the_same_steps_and_another_other_ones(tmp_path, demo_assets, demo_cache):
    model_dir, (train_file, *_) = demo_assets
    # the three jobs at once: each is deterministic on its own (one thread a side), and they spend much of their
    # time starting up
    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(run_job, tmp_path, name, model_dir, train_file, demo_cache, seed)
                for name, seed in (("a", 0), ("b", 0), ("c", 1))]
        (first, first_groups), (again, again_groups), (other, other_groups) = [job.result() for job in jobs]
    assert [step for step, *_ in first] == list(range(1, STEPS + 1)) and any(loss for _, loss, _ in first)
    assert again == first and again_groups == first_groups, (first, again)  # bit-identical
    assert [prompts for prompts, _ in other_groups] == [prompts for prompts, _ in first_groups]  # file order
    assert other != first and other_groups != first_groups, (first, other)  # sampled otherwise: generator.seed
