"""bench/generator_speed.py's repeats: every contender runs once per repeat, in a rotated order, and the ratio to
the faster raw path is taken within each repeat (its median and range reported); the contenders' own processes are
tests/e2e/test_bench.py's."""
import asyncrl.bench.generator_speed as bench


def test_repeats_interleave_the_contenders_and_the_ratio_is_paired_within_each_repeat(monkeypatch, capsys):
    calls = []
    # the machine slows down by half in the second repeat: a paired ratio does not see it
    speed = {"hf_generate": 100.0, "vllm_generate": 200.0, "asyncrl_vllm": 180.0}

    def fake(name, rounds, threads, overrides):
        repeat = sum(1 for call in calls if call == name)
        calls.append(name)
        rate = speed[name] * (0.5 if repeat == 1 else 1.0)
        result = {"tokens": 10, "seconds": 10 / rate, "tokens_per_s": rate, "batch_s": 1.0}
        return {**result, "group_work_s": 0.01 * (repeat + 1)} if name.startswith("asyncrl_") else result

    monkeypatch.setattr(bench, "in_subprocess", fake)
    result = bench.main(["--repeats", "3", "--contenders", "hf_generate,vllm_generate,asyncrl_vllm"])
    assert calls[:3] == ["hf_generate", "vllm_generate", "asyncrl_vllm"]
    assert calls[3:6] == ["vllm_generate", "asyncrl_vllm", "hf_generate"]  # rotated
    assert calls[6:] == ["asyncrl_vllm", "hf_generate", "vllm_generate"]
    assert result["faster_raw"] == "vllm_generate" and result["best_engine"] == "asyncrl_vllm"
    assert result["ratio"] == 0.9 and result["ratio_range"] == [0.9, 0.9]
    assert result["rows"]["asyncrl_vllm"]["tokens_per_s_range"] == [90.0, 180.0]
    assert result["rows"]["asyncrl_vllm"]["vs_own_raw"] == 0.9  # against vllm_generate, paired
    assert "vs_own_raw" not in result["rows"]["hf_generate"]
    assert result["rows"]["asyncrl_vllm"]["group_work_s"] == 0.02  # the rollout's own work: median over repeats
    assert "group_work_s" not in result["rows"]["vllm_generate"]
    assert "median (min-max)" in capsys.readouterr().out
