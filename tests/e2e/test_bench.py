"""Benchmarks are not tests; this only checks that each one runs on a tiny setting and ends with a JSON line."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import DEMO, free_port
from tests.e2e.jobs import QUIET_TELEMETRY


TINY_DEMO = [*DEMO, "buffer.groups_per_step=2", "rollout.n=2", "generator.max_inflight_groups=2"]


@pytest.mark.slow
def test_time_to_reward_bench_runs_the_suites_sort_task_through_the_judge(tmp_path, demo_assets, demo_cache):
    """The suite's `sort` task, asyncrl's default and TRL's, 3 steps each, and the judge on both final models (4
    held-out prompts, 2 samples at T = 1). Dynamic sampling is off, so the run's length does not depend on how
    often the warm start is right. HOME is the test's: the sort task's held-out split is written under the demo's
    default cache."""
    overrides = [f"demo.cache_dir={demo_cache}", *TINY_DEMO, f"buffer.port={free_port()}",
                 "algo.dynamic_sampling=false", *QUIET_TELEMETRY]
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.time_to_reward", "--tasks", "sort", "--root",
                          str(tmp_path / "suite"), "--seeds", "0", "--configs", "default", "trl", "--steps", "3",
                          "--window", "2", "--final-steps", "2", "--target", "0.0", "--judge-n", "2", "--judge-ks",
                          "1", "2", "--judge-prompts", "4", *overrides],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "time_to_reward" and result["seeds"] == [0] and result["tasks"] == ["sort"]
    runs = result["runs"]["sort"]
    assert set(runs) == {"asyncrl default", "TRL GRPOTrainer"}
    for name, (run,) in runs.items():
        assert run["steps"] == 3 and run["samples_per_s"] > 0, (name, run)
        assert run["time_to_target_s"] is not None and 0 <= run["reward_final"] <= 1  # a target of 0 is reached
        assert 0 <= run["heldout_greedy_reward"] <= 1 and 0 <= run["heldout_pass_at_1"] <= run["heldout_pass_at_2"]
    (async_,) = runs["asyncrl default"]
    assert async_["staleness_mean"] <= 1 and 0 <= async_["learner_idle_frac"] <= 1
    assert [row["task"] for row in result["summary"]] == ["sort", "median over 1 tasks"]
    assert "| asyncrl default |" in out.stdout and "| TRL GRPOTrainer |" in out.stdout  # the task's table


@pytest.mark.slow
def test_sppo_preference_bench_trains_on_a_served_reward_model_and_judges_its_model(tmp_path, demo_assets,
                                                                                     demo_cache):
    """The reward model trained (20 steps, on the warm start's own samples of 16 prompts and on
    corruptions), served by the real `asyncrl reward-server`, and SPPO on it, 3 steps, judged on 4 held-out prompts
    (the verifiable reward's baseline run is the recipes' SPPO job, left out for time). The run samples the reward
    model's scores, not 0/1 rewards. HOME is the test's: the judge's held-out split is under the demo's cache."""
    overrides = [f"demo.cache_dir={demo_cache}", *TINY_DEMO, f"buffer.port={free_port()}",
                 "algo.dynamic_sampling=false", *QUIET_TELEMETRY]
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.sppo_preference", "--steps", "3", "--rm-steps", "20",
                          "--rm-batch", "16", "--rm-prompts", "16", "--final-steps", "2", "--judge-n", "2",
                          "--judge-ks", "1", "2", "--judge-prompts", "4", "--no-baseline", "--work-dir",
                          str(tmp_path / "work"), *overrides],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "sppo_preference" and 0 <= result["rm_heldout_pair_accuracy_corrupted"] <= 1
    assert result["rm_heldout_policy_pairs"] == 0 or 0 <= result["rm_heldout_pair_accuracy_policy"] <= 1
    assert list(result["runs"]) == ["sppo, reward model"]  # --no-baseline: the verifiable reward's run left out
    (preference,) = result["runs"]["sppo, reward model"]
    assert preference["steps"] == 3 and preference["samples_per_s"] > 0
    assert 0 <= preference["heldout_greedy_reward"] <= 1  # the judge scores it with the verifiable reward
    rows = [json.loads(line) for line in open(tmp_path / "work" / "seed0-rm" / "progress.jsonl")]
    sampled = [row["reward/sampled_mean"] for row in rows if "reward/sampled_mean" in row]
    assert sampled and any(value not in (0.0, 1.0) for value in sampled)  # the reward model's scores
    assert "reward/rm/mean" in rows[-1]  # the component, by its name
    assert "| sppo, reward model |" in out.stdout


@pytest.mark.slow
def test_tool_latency_bench_runs_episodes_at_two_etas_on_a_tiny_setting(tmp_path, demo_assets, demo_cache):
    # episode metrics travel in the generator's log window: short steps can take under a second, so the window is
    # a tenth of one and the run 6 steps (with 1 s, and once with 0.2 s and 4 steps in CI, a run whose steps all fell
    # inside the first window had no episode metrics)
    overrides = [f"demo.cache_dir={demo_cache}", *TINY_DEMO, f"buffer.port={free_port()}",
                 "generator.log_every_s=0.1"]
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.tool_latency", "--seeds", "0", "--etas", "0", "1",
                          "--steps", "6", "--slow-s", "0.3", "--slow-p", "0.5", "--inflight", "4", *overrides],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "tool_latency" and result["ratio"]["1"] > 0
    for eta in ("0", "1"):
        (run,) = result["runs"][eta]
        assert run["steps"] == 6 and run["samples_per_s"] > 0
        # episodes answered, waited on the tool, answered again; a first answer cut by max_tokens ends its episode
        assert 1.0 < run["turns_mean"] <= 2.0
    assert "| η = 1 |" in out.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_generator_speed_bench_runs_its_contenders_on_a_tiny_setting(tmp_path, demo_assets, demo_cache):
    """Raw HF generate and both asyncrl engines; raw vLLM generate is left out (each contender is its own process,
    and one more vLLM start costs CI about a minute; vLLM's own offline API is not asyncrl's code)."""
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.generator_speed", "--rounds", "1", "--repeats", "1",
                          "--contenders", "hf_generate,asyncrl_hf,asyncrl_vllm",
                          f"demo.cache_dir={demo_cache}", *TINY_DEMO, "generator.kv_cache_gib=0.25"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "generator_speed" and result["ratio"] > 0
    assert set(result["rows"]) == {"hf_generate", "asyncrl_hf", "asyncrl_vllm"}
    assert all(row["tokens"] > 0 and row["tokens_per_s"] > 0 for row in result["rows"].values())


@pytest.mark.slow
def test_learner_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.learner", "--rounds", "1", "--groups", "2", "--hidden",
                          "64", "--layers", "1", "--seq-len", "256"], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "learner"
    assert result["overhead"]["ratio"] > 0 and result["packing"]["speedup"] > 0
    precision = result["precision"]
    assert precision["speedup"] > 0 and 0 < precision["logprob_abs_diff_mean"] <= precision["logprob_abs_diff_max"]
    assert 0 < result["sp_memory"]["activation_ratio"] < 1  # SP = 2 keeps less per rank than SP = 1


@pytest.mark.slow
def test_learner_profile_runs_the_demos_step_on_a_tiny_setting(tmp_path, demo_assets, demo_cache):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.learner_profile", "--steps", "1", "--top", "3",
                          f"demo.cache_dir={demo_cache}", *TINY_DEMO], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "learner_profile" and result["rows"] == 4  # 2 groups x 2 samples
    assert result["aten_calls_per_step"] > 0 and result["step_s_median"] > 0
    assert "aten::mm" in out.stdout  # the ops table


@pytest.mark.slow
@pytest.mark.redis
def test_buffer_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.buffer", "--count", "40", "--repeats", "1",
                          "--compare-loops"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "buffer" and result["loop"] == "uvloop"
    assert set(result["paths"]) == set(result["loops"]) == {"zmq/4KB", "zmq/64KB", "redis/4KB", "redis/64KB"}
    for pair in [*result["paths"].values(), *result["loops"].values()]:
        assert pair["ratio"] > 0 and pair["backend"]["p99_ms"] >= pair["backend"]["p50_ms"] > 0
        for side in ("raw", "backend"):
            assert pair["cpu_us"][side]["consumer"] > 0 and pair["cpu_us"][side]["producer"] > 0
    assert "uv/aio" in out.stdout


@pytest.mark.slow
def test_weightsync_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.weightsync", "--mb", "8", "--versions", "2",
                          "--receivers", "1,2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "weightsync" and 7 < result["mb"] < 9
    assert result["publish"]["ratio"] > 0 and sum(result["publish"]["staged_by"].values()) == 2
    assert set(result["fanout"]) >= {"1", "2"} and result["fanout"]["1"]["x1"] == 1.0
    assert result["stall"]["path"] == "shm"
    assert result["stall"]["median_transfer_s"] > 0 and result["stall"]["median_stall_s"] > 0
    assert result["cast"]["cast_in_copy_s"] > 0 and result["cast"]["to_then_copy_s"] > 0


def test_weightsync_delta_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.weightsync_delta", "--steps", "2", "--settings",
                          "tiny:bfloat16:1e-6", "tiny:float32:1e-4"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "weightsync_delta"
    for mode, hits in (("on demand", 0), ("prepared", 1)):  # step 2 finds its delta encoded ahead
        small = result["settings"][f"tiny/bfloat16/lr=1e-06/{mode}"]
        full = result["settings"][f"tiny/float32/lr=0.0001/{mode}"]
        assert small["deltas_used"] == 2 and 0 < small["bytes_frac"] < 0.5 and small["changed_frac"] < 0.5
        assert small["prepared_hits"] == hits
        assert full["deltas_used"] == 0 and full["bytes_frac"] == 1.0 and full["changed_frac"] == 1.0  # fp32: all
        assert full["prepared_hits"] == 0


@pytest.mark.slow
def test_weightsync_fanout_bench_runs_on_a_tiny_setting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.weightsync_fanout", "--mb", "4", "--repeats", "1",
                          "--receivers", "1,2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "weightsync_fanout" and result["mb"] == 4
    for mode in ("chain", "broadcast"):
        assert set(result[mode]) == {"1", "2"} and all(seconds > 0 for seconds in result[mode].values())


def test_plan_check_bench_runs_both_checks_on_a_tiny_setting(tmp_path):
    from tests.planner_jobs import write_job

    runs = [str(write_job(tmp_path / f"eta{eta}", eta=eta)) for eta in (0, 1)]
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.plan_check", "--small", "--steps", "60", "--runs",
                          *runs], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["closed_form"]["points"] == 4 and result["closed_form"]["max_abs_error"] < 0.5
    assert result["runs"]["runs"] == 2 and "closed form" in out.stdout and "staleness run" in out.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_agent_prefix_bench_sees_turn_k_reuse_turn_k_minus_1s_cache_on_a_tiny_setting(tmp_path):
    """Prefix caching on only (one vLLM start; `off` is the same engine with caching off and doubles the test's
    time): turn 1 is cold, turn 4 finds the blocks of the history before its new environment message cached."""
    out = subprocess.run([sys.executable, "-m", "asyncrl.bench.agent_prefix", "--modes", "on", "--repeats", "1",
                          "--first", "120", "--reply", "8", "--env", "16", "--hidden", "64", "--layers", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "agent_prefix" and set(result["table"]) == {"on"}
    turns = result["table"]["on"]
    assert [turn["turn"] for turn in turns] == [1, 2, 3, 4]
    assert turns[0]["cached"] == 0 and all(turn["ttft_ms"] > 0 for turn in turns)
    assert 0 < turns[3]["cached"] < turns[3]["prompt"]  # reused, and the new message was prefilled
    assert "| on | 4 |" in out.stdout
