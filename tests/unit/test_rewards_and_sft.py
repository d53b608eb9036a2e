import os
import subprocess
import sys

import pytest

from asyncrl.generator.rewards import RewardError, load_reward_fn, score


def test_user_reward_function_plugs_in_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def judge(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': float(solution_str == ground_truth), 'length': len(solution_str)}\n")
    fn = load_reward_fn(str(path), "judge")
    assert score(fn, "mine", "abc", "abc", None) == (1.0, {"length": 3.0})
    with pytest.raises(RewardError, match="nope"):
        load_reward_fn(str(path), "nope")


def test_builtin_reward_dispatches_on_data_source_and_names_unknown_ones():
    fn = load_reward_fn(None, "compute_score")
    assert score(fn, "asyncrl/sort_digits", "0125", "0125", None)[0] == 1.0
    assert score(fn, "asyncrl/sort_digits", "0152", "0125", None)[0] == 0.0
    with pytest.raises(RewardError, match="other/source"):
        score(fn, "other/source", "x", "y", None)


def test_non_finite_reward_is_an_error():
    with pytest.raises(RewardError, match="non-finite"):
        score(lambda *a: float("nan"), "s", "x", "y", None)


@pytest.mark.slow
@pytest.mark.parametrize("launch", [[], ["--nproc", "2", "learner.sp_size=2", "learner.packing=true"]],
                         ids=["one-process", "two-ranks-ulysses-packed"])
def test_asyncrl_sft_trains_and_saves_a_model(tmp_path, demo_assets, demo_cache, launch):
    env = {**os.environ, "ASYNCRL_JOB_DIR": str(tmp_path / "job")}
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "sft", *launch, f"demo.cache_dir={demo_cache}",
                          "demo.sft_steps=20", "demo.num_prompts=256", "sft.steps=10", "sft.batch_size=32"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, last = (float(x) for x in out.stdout.split("loss ")[1].split(";")[0].split(" -> "))
    assert last < first
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "job" / "model")  # full weights, not a shard
    assert saved.get_output_embeddings().weight.shape[0] == saved.config.vocab_size
