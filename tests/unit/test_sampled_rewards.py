"""The reward of everything the policy sampled (buffer/sampled.py) and the check that a job can learn at all
(learner/learnable.py): the tally, the validation of what a release carries, the decision, and what is printed."""
import pytest

from asyncrl.buffer.sampled import MAX_DISTINCT_VALUES, SampledRewards, check_released_rewards
from asyncrl.telemetry.progress import format_line


def test_the_window_is_the_mean_over_every_sample_of_every_group_since_the_last_step():
    tally = SampledRewards()
    assert tally.take_window() == {}  # nothing sampled: no made-up 0
    tally.add([0.0, 0.0, 0.0, 0.0])  # filtered by a generator
    tally.add([1.0, 0.0, 1.0, 1.0])  # trained
    window = tally.take_window()
    assert window["reward/sampled_mean"] == pytest.approx(3 / 8)
    assert window["reward/sampled_groups"] == 2.0 and window["reward/sampled_frac_zero_std_groups"] == 0.5
    tally.add([1, 1])
    assert tally.take_window() == {"reward/sampled_mean": 1.0, "reward/sampled_groups": 1.0,
                                   "reward/sampled_frac_zero_std_groups": 1.0}
    seen = tally.seen()  # since the start, whatever the windows
    assert (seen.groups, seen.varied_groups, seen.equal_groups) == (3, 1, 2)
    assert seen.equal_values == ((0.0, 1), (1.0, 1))


def test_the_equal_values_kept_apart_are_bounded_whatever_a_generator_sends():
    tally = SampledRewards()
    for value in range(MAX_DISTINCT_VALUES + 5):
        tally.add([float(value)] * 2)
    tally.add([0.0, 0.0])
    seen = tally.seen()
    assert len(seen.equal_values) == MAX_DISTINCT_VALUES and seen.equal_other == 5
    assert seen.equal_values[0] == (0.0, 2) and seen.groups == MAX_DISTINCT_VALUES + 6


@pytest.mark.parametrize("rewards, problem", [
    ([0.0, 1.0], None), ((2, 2), None),
    ([float("nan"), 0.0], "rewards[0]"), ([0.0, float("inf")], "rewards[1]"), (["0.0", 1.0], "rewards[0]"),
    ([True, False], "rewards[0]"), ([[0.0], 1.0], "rewards[0]"), ([1e39, 0.0], "rewards[0]"),
    ("0.0", "must be a list"), ({"a": 1}, "must be a list"), (None, "must be a list"),
    ([], "0 rewards"), ([0.0] * 5, "5 rewards, expected 1 to 4"),
])
def test_what_a_release_carries_is_checked_as_hostile_input(rewards, problem):
    found = check_released_rewards(rewards, group_size=4)
    assert found is None if problem is None else problem in found
    assert check_released_rewards([0.0] * 5000, group_size=None) is not None  # bounded without the job's n too


def test_the_live_line_shows_the_sampled_reward_first_and_the_trained_one_named():
    line = format_line(3, 10, {"reward/sampled_mean": 0.41, "reward/mean": 0.52}, 30.0)
    assert "reward 0.410 sampled, 0.520 trained |" in line
    assert "reward 0.520 trained |" in format_line(3, 10, {"reward/mean": 0.52}, 30.0)  # a row from before


def test_the_closing_summary_prints_the_sampled_reward_first_and_names_the_trained_one(capsys):
    from asyncrl.launch.job import print_summary
    from asyncrl.telemetry.run_record import first_and_last

    sampled, trained = [0.1, 0.3, 0.5, 0.7], [0.4, 0.6, 0.8, 0.9]
    summary = {"steps": 4, "reward_window_steps": 2, **first_and_last("sampled_reward", sampled, 2),
               **first_and_last("trained_reward", trained, 2), "mlflow_tracking_uri": "sqlite:///m.db",
               "mlflow_run_id": "r"}
    assert (summary["sampled_reward_first"], summary["sampled_reward_last"]) == pytest.approx((0.2, 0.6))
    print_summary(summary)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "reward of every group sampled: first 2 steps 0.200 -> last 2 steps 0.600 (4 steps)"
    assert lines[1] == "reward of the trained groups: first 2 steps 0.500 -> last 2 steps 0.850 (4 steps)"
    assert first_and_last("sampled_reward", [], 1) == {"sampled_reward_first": None, "sampled_reward_last": None}
