"""data.source=reasoning_gym: rows built from the package's generators (data/reasoning_gym.py), the same for the same
seed, scored by its own verifiers (generator/rewards/builtin/reasoning_gym_score.py)."""
import pytest

pytest.importorskip("reasoning_gym")

from asyncrl.data.reasoning_gym import reasoning_gym_rows  # noqa: E402
from asyncrl.generator.rewards.functions import builtin_reward, check_builtin_rewards, score  # noqa: E402
from asyncrl.generator.rewards.builtin.reasoning_gym_score import final_answer  # noqa: E402


def test_rows_are_verl_rows_the_same_on_every_generator_and_scored_by_the_packages_verifier():
    rows = reasoning_gym_rows(["basic_arithmetic"], 8, seed=3)
    assert rows == reasoning_gym_rows(["basic_arithmetic"], 8, seed=3) and len(rows) == 8
    row = rows[0]
    assert row["data_source"] == "reasoning_gym/basic_arithmetic" and row["_id"] == "reasoning_gym/basic_arithmetic:0"
    assert row["prompt"][0]["content"].endswith("inside <answer></answer>.")
    check_builtin_rewards({row["data_source"]})
    truth = row["reward_model"]["ground_truth"]
    right = score(builtin_reward, row["data_source"], f"thinking...\n<answer>{truth}</answer>", truth,
                  row["extra_info"])
    wrong = score(builtin_reward, row["data_source"], "<answer>not a number</answer>", truth, row["extra_info"])
    assert right == (1.0, {"answer_found": 1.0}) and wrong[0] == 0.0


def test_answers_come_from_the_last_tag_or_the_last_line_and_bad_rows_or_tasks_are_errors():
    assert final_answer("<answer>1</answer> no, <answer> 2 </answer>") == "2"
    assert final_answer("so\n\n 42 \n") == "42" and final_answer("   ") is None
    with pytest.raises(ValueError, match="cannot make 'no_such_task'"):
        reasoning_gym_rows(["no_such_task"], 2, seed=0)
    with pytest.raises(ValueError, match="no reasoning-gym entry"):
        builtin_reward("reasoning_gym/basic_arithmetic", "<answer>1</answer>", "1", {})


def test_the_config_asks_for_tasks():
    from asyncrl.configs import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs data.reasoning_gym_tasks"):
        load_config(None, ["data.source=reasoning_gym"])
    with pytest.raises(ConfigError, match="data.source must be one of"):
        load_config(None, ["data.source=hub"])
