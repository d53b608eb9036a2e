"""A job that cannot learn says so at once: with a reward function that always returns 0 and dynamic sampling on (the
demo recipe), every group is dropped; `asyncrl run` stops within a minute of the first sample, with the rewards
seen and what to check, instead of at learner.wait_for_batch_timeout_s (600 s), and leaves nothing running."""
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import children_of, supervised_overrides as overrides

ZERO_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
'''


@pytest.mark.slow
def test_asyncrl_run_stops_when_every_group_scores_alike_and_says_what_to_check(tmp_path, demo_assets, demo_cache):
    job_dir = tmp_path / "job"
    (tmp_path / "zero_reward.py").write_text(ZERO_REWARD)
    env = {**os.environ, "ASYNCRL_JOB_DIR": str(job_dir), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db",
           "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", *overrides(demo_cache, free_port()),
                          f"reward.path={tmp_path}/zero_reward.py", "algo.unlearnable_after_groups=64",
                          "learner.total_steps=100000"], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    took = time.monotonic() - started
    assert out.returncode == 1, out.stderr[-3000:]
    assert "the learner exited with code 1" in out.stderr
    for needle in ("nothing to learn", "all with equal rewards", "at 0.0", "the reward function", "the warm start",
                   "algo.dynamic_sampling", "algo.unlearnable_after_groups=0"):
        assert needle in out.stderr, out.stderr[-3000:]
    assert took < 240, f"{took:.0f} s"  # model loads and startup included; the wait itself is seconds
    assert children_of(str(job_dir)) == []
    generator_log = (job_dir / "gen-0.log").read_text()
    assert "Traceback" not in generator_log  # told the job is over, as at a normal end
