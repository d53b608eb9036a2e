"""The soak (bench/soak/run.py) on a tiny setting: two minutes of one job with two generators in network namespaces
of their own, a rogue generator and a liar, while a learner kill, a generator kill, a partition, a full checkpoint
disk and a hostile burst are injected; the history checker must find every prompt trained once per epoch, no hostile
group trained, the liar stopped within its window, every fault followed by a trained step, no generator exiting on
its own (each waits for a learner that resumes or is cut off from it), and every generator ended within the stop
bound. It needs root (network namespaces, a tmpfs), as CI has; the hour runs on demand
(docs/benchmarks.md, "The soak")."""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_soak_short_tier_holds_under_every_fault_on_zmq(tmp_path, demo_cache):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the soak needs root and iproute2 (network namespaces, a tmpfs): CI has both")
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.soak.run", f"demo.cache_dir={demo_cache}", "--tier",
                          "short", "--minutes", "2", "--generators", "2", "--work", str(tmp_path / "soak"),
                          "--faults", "stop_generator=0", "slow_link=0", "kill_during_load=0", "kill_generator=1",
                          "kill_learner=1", "partition=1", "full_disk=1", "hostile=1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.stdout.strip(), out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and result["ok"], out.stdout[-3000:] + out.stderr[-3000:]
    assert result["faults"] == {"kill_generator": 1, "kill_learner": 1, "partition": 1, "full_disk": 1, "hostile": 1}
    assert result["learner_lives"] == 2 and result["prompts_lost"] == result["prompts_duplicated"] == 0
    assert result["hostile_sent"] > 0 and result["hostile_trained"] == 0 and result["liar_trained"] <= 16
    assert all(fault["to_next_step_s"] is not None for fault in result["recovery"])
    # no generator gave up on the learner while it resumed or while partitioned from it: each waited for it
    assert result["generator_exits"] == []
    assert set(result["generator_stop_s"]) == {"gen-0", "gen-1"}
    assert all(seconds < 15 for seconds in result["generator_stop_s"].values())
