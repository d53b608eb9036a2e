"""Reward functions: user files, the built-in dispatch on data_source, non-finite rewards (`asyncrl sft` as a
process: tests/integration/test_cli.py)."""
import pytest

from asyncrl.generator.rewards.errors import RewardError
from asyncrl.generator.rewards.functions import load_reward_fn, score


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
