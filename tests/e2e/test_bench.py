"""Benchmarks are not tests; this only checks that each one runs on a tiny setting and ends with a JSON line."""
import json
import subprocess
import sys

import pytest

from tests.conftest import free_port


@pytest.mark.slow
def test_async_vs_sync_bench_runs_on_a_tiny_setting(tmp_path, demo_assets, demo_cache):
    overrides = [f"demo.cache_dir={demo_cache}", "demo.sft_steps=20", "demo.num_prompts=256",
                 f"buffer.port={free_port()}", "buffer.groups_per_step=2", "rollout.n=2", "generator.engine=hf",
                 "generator.max_inflight_groups=2"]
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.async_vs_sync", "--steps", "3", "--eta", "1",
                          *overrides], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "async_vs_sync" and result["speedup"] > 0
    assert result["sync"]["eta"] == 0 and result["async"]["eta"] == 1


@pytest.mark.slow
def test_learner_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.learner", "--rounds", "1", "--groups", "2", "--hidden",
                          "64", "--layers", "1", "--seq-len", "256"], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "learner"
    assert result["overhead"]["ratio"] > 0 and result["packing"]["speedup"] > 0
    assert 0 < result["sp_memory"]["activation_ratio"] < 1  # SP = 2 keeps less per rank than SP = 1


@pytest.mark.slow
@pytest.mark.redis
def test_buffer_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.buffer", "--count", "40", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "buffer"
    assert set(result["paths"]) == {"zmq/4KB", "zmq/64KB", "redis/4KB", "redis/64KB"}
    for pair in result["paths"].values():
        assert pair["ratio"] > 0 and pair["backend"]["p99_ms"] >= pair["backend"]["p50_ms"] > 0
        for side in ("raw", "backend"):
            assert pair["cpu_us"][side]["consumer"] > 0 and pair["cpu_us"][side]["producer"] > 0


@pytest.mark.slow
def test_weightsync_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.weightsync", "--mb", "8", "--versions", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "weightsync" and 7 < result["mb"] < 9
    assert result["publish"]["ratio"] > 0 and sum(result["publish"]["staged_by"].values()) == 2
    assert set(result["fanout"]) >= {"1", "2", "4"} and result["fanout"]["1"]["x1"] == 1.0
    assert result["stall"]["path"] == "shm"
    assert result["stall"]["median_transfer_s"] > 0 and result["stall"]["median_stall_s"] > 0
    assert result["cast"]["cast_in_copy_s"] > 0 and result["cast"]["to_then_copy_s"] > 0


@pytest.mark.slow
def test_weightsync_fanout_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.weightsync_fanout", "--mb", "4", "--repeats", "1",
                          "--receivers", "1,2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "weightsync_fanout" and result["mb"] == 4
    for mode in ("chain", "broadcast"):
        assert set(result[mode]) == {"1", "2"} and all(seconds > 0 for seconds in result[mode].values())
