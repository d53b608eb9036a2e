"""The soak (bench/soak/run.py) on a tiny setting: four minutes of one job with two generators in network namespaces of
their own, a rogue generator and a liar, while one fault of every kind the zmq variant has is injected (two hostile
bursts); the history checker must find every prompt trained once per epoch, no hostile group trained, the liar
stopped within its window, every fault followed by a trained step, no generator exiting on its own (each waits for a
learner that resumes or is cut off from it), every generator ending within η of the last published version, and
within the stop bound. It needs root (network namespaces, a tmpfs), as CI has; the hour runs on demand
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
                          "short", "--minutes", "4", "--generators", "2", "--work", str(tmp_path / "soak"),
                          "--subnet", "10.239.0"],  # not the default's: an hour soak may be running beside the tests
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.stdout.strip(), out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and result["ok"], out.stdout[-3000:] + out.stderr[-3000:]
    assert result["faults"] == {"kill_generator": 1, "stop_generator": 1, "kill_learner": 1, "partition": 1,
                                "slow_link": 1, "kill_during_load": 1, "full_disk": 1, "hostile": 2}
    assert result["learner_lives"] == 2 and result["prompts_lost"] == result["prompts_duplicated"] == 0
    assert result["hostile_sent"] > 0 and result["hostile_trained"] == 0 and result["liar_trained"] <= 16
    assert all(fault["to_next_step_s"] is not None for fault in result["recovery"])
    # no generator gave up on the learner while it resumed or while partitioned from it: each waited for it
    assert result["generator_exits"] == []
    assert set(result["generator_final_versions"]) == {"gen-0", "gen-1"}
    assert all(result["last_step"] - 1 <= version <= result["last_step"]
               for version in result["generator_final_versions"].values())
    assert set(result["generator_stop_s"]) == {"gen-0", "gen-1"}
    assert all(seconds < 15 for seconds in result["generator_stop_s"].values())
