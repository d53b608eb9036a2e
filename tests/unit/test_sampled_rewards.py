"""The reward of everything the policy sampled (buffer/sampled.py) and the check that a job can learn at all
(learner/learnable.py): the tally, the validation of what a release carries, the decision, and what is printed."""
import logging

import pytest

from asyncrl.buffer.sampled import MAX_DISTINCT_VALUES, SampledRewards, SampledSoFar, check_released_rewards
from asyncrl.learner.collect import BatchFilter, collect_batch
from asyncrl.learner.learnable import (LearnableWatch, NothingToLearn, describe_rewards, is_unlearnable,
                                       unlearnable_message)
from asyncrl.telemetry.progress import format_line
from tests.queue_server import QueueServer, make_group


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


def seen_equal(groups: int, values=((0.0, None),)) -> SampledSoFar:
    return SampledSoFar(groups, 0, tuple((value, count or groups) for value, count in values))


def test_the_decision_needs_enough_groups_and_none_that_varied_and_zero_never_decides():
    assert not is_unlearnable(seen_equal(255), 256)
    assert is_unlearnable(seen_equal(256), 256) and is_unlearnable(seen_equal(1000), 256)
    assert not is_unlearnable(SampledSoFar(1000, 1, ((0.0, 999),)), 256)
    assert not is_unlearnable(seen_equal(10 ** 6), 0)


def test_the_message_shows_the_rewards_seen_and_what_to_check():
    seen = SampledSoFar(1840, 0, ((0.0, 1800), (1.0, 30)), equal_other=10)
    assert describe_rewards(seen) == ("1840 groups sampled, all with equal rewards: 1800 at 0.0, 30 at 1.0, "
                                      "10 at other values")
    message = unlearnable_message(seen, 256, dynamic_sampling=True)
    for needle in ("1800 at 0.0", "reward function", "warm start", "algo.dynamic_sampling",
                   "algo.unlearnable_after_groups=0", "stops"):
        assert needle in message
    assert "goes on" in unlearnable_message(seen, 256, dynamic_sampling=False)


def test_the_watch_stops_with_dynamic_sampling_warns_once_without_and_one_varied_group_disarms_it(caplog):
    tally = SampledRewards()
    for _ in range(4):
        tally.add([0.0, 0.0])
    with pytest.raises(NothingToLearn, match="4 groups sampled, all with equal rewards: 4 at 0.0"):
        LearnableWatch(tally.seen, 4, dynamic_sampling=True).check()
    LearnableWatch(tally.seen, 5, dynamic_sampling=True).check()  # not enough evidence yet
    LearnableWatch(tally.seen, 0, dynamic_sampling=True).check()  # told to wait
    warning = LearnableWatch(tally.seen, 4, dynamic_sampling=False)
    with caplog.at_level(logging.WARNING, logger="asyncrl.learner.learnable"):
        warning.check()
        warning.check()
        LearnableWatch(tally.seen, 4, dynamic_sampling=True).check(may_stop=False)  # after a step: warns only
    assert [record.getMessage().count("nothing to learn") for record in caplog.records] == [1, 1]
    learning = LearnableWatch(tally.seen, 6, dynamic_sampling=True)
    tally.add([0.0, 1.0])
    learning.check()
    assert not learning.armed
    for _ in range(10):
        tally.add([0.0, 0.0])
    learning.check()  # a policy that learned and then saturates is not a broken job


def test_a_slow_fleet_hears_within_a_minute_that_every_group_so_far_scored_alike(caplog):
    """1024 groups may take a slow fleet many minutes; the first minute of alike groups is said once, not stopped."""
    tally, now = SampledRewards(), [0.0]
    watch = LearnableWatch(tally.seen, 1024, dynamic_sampling=True, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="asyncrl.learner.learnable"):
        watch.check()  # nothing sampled yet: the minute has not started
        now[0] = 100.0
        tally.add([0.0, 0.0])
        watch.check()
        now[0] = 159.0
        tally.add([0.0, 0.0])
        watch.check()
        assert not caplog.records
        now[0] = 161.0
        watch.check()
        watch.check()
    assert len(caplog.records) == 1 and "2 groups sampled, all with equal rewards: 2 at 0.0 so far (61 s" in (
        caplog.records[0].getMessage()) and "stops after algo.unlearnable_after_groups=1024" in caplog.text
    varied, now[0] = LearnableWatch(tally.seen, 1024, dynamic_sampling=True, clock=lambda: now[0]), 0.0
    tally.add([0.0, 1.0])
    varied.check()
    now[0] = 1000.0
    varied.check()  # a group that differs: nothing to say
    assert len(caplog.records) == 1


class TallyingServer(QueueServer):
    """collect_batch's buffer, adding every group it hands out to the sampled tally as both backends do."""

    def __init__(self, groups):
        super().__init__(groups)
        self.sampled = SampledRewards()

    def take(self, timeout):
        group = super().take(timeout)
        if group is not None:
            self.sampled.add(group.rewards())
        return group


def test_collect_batch_stops_at_once_when_every_group_scores_alike_instead_of_waiting_for_its_timeout():
    server = TallyingServer([make_group([0, 0, 0]) for _ in range(6)])
    watch = LearnableWatch(server.sampled.seen, 5, dynamic_sampling=True)
    with pytest.raises(NothingToLearn, match="5 groups sampled"):  # checked before each take
        collect_batch(server, 2, 1, 0, timeout_s=600, batch_filter=BatchFilter(dynamic_sampling=True),
                      watch=watch.check)
    assert server.reasons == ["zero_variance"] * 5


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


def test_when_the_data_ends_before_enough_groups_every_group_it_gave_is_the_evidence():
    """data.epochs ran out with every group filtered: the job would end with no step and nothing said."""
    server = TallyingServer([make_group([1, 1, 1]) for _ in range(3)])
    watch = LearnableWatch(server.sampled.seen, 1024, dynamic_sampling=True)
    with pytest.raises(NothingToLearn, match="3 groups sampled, all with equal rewards: 3 at 1.0"):
        collect_batch(server, 2, 1, 0, timeout_s=600, batch_filter=BatchFilter(dynamic_sampling=True),
                      data_done=lambda: server.groups.empty(), watch=watch.check)
    varied = TallyingServer([make_group([0, 1, 1])])
    out = collect_batch(varied, 2, 1, 0, timeout_s=600, batch_filter=BatchFilter(dynamic_sampling=True),
                        data_done=lambda: varied.groups.empty(),
                        watch=LearnableWatch(varied.sampled.seen, 1024, dynamic_sampling=True).check)
    assert out.final and len(out.groups) == 1  # the last, short batch of a job that learns: as before
