"""Idle fractions: the busy clock, the generator's report and the fleet's mean the learner logs."""
import pytest

from asyncrl.buffer.fleet_stats import fleet_metrics
from asyncrl.generator.rollout import RolloutStats
from asyncrl.telemetry.timing import BusyClock, idle_fraction, share


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_overlapping_work_counts_once_and_the_running_stretch_is_included():
    clock = FakeClock()
    busy = BusyClock(clock)
    with busy:
        clock.now += 1.0
        with busy:  # a second group sampled alongside: the same wall second, not two
            clock.now += 2.0
        clock.now += 1.0
    clock.now += 5.0  # idle
    assert busy.total() == pytest.approx(4.0)
    busy.__enter__()
    clock.now += 0.5
    assert busy.total() == pytest.approx(4.5)  # still running
    busy.__exit__(None, None, None)
    assert busy.busy_s == pytest.approx(4.5)


def test_fractions_are_clamped_and_an_empty_window_is_zero():
    assert share(1.0, 4.0) == 0.25 and share(5.0, 4.0) == 1.0 and share(-1.0, 4.0) == 0.0 and share(1.0, 0.0) == 0.0
    assert idle_fraction(1.0, 4.0) == 0.75 and idle_fraction(9.0, 4.0) == 0.0 and idle_fraction(0.0, 0.0) == 0.0


def test_each_report_gives_the_idle_fraction_of_its_own_window():
    clock = FakeClock()
    stats = RolloutStats(clock)
    with stats.busy:
        clock.now += 3.0
    clock.now += 1.0
    assert stats.snapshot(0)["timing/generator/idle_frac"] == pytest.approx(0.25)
    clock.now += 2.0  # a window with nothing to do
    assert stats.snapshot(0)["timing/generator/idle_frac"] == pytest.approx(1.0)
    with stats.busy:
        clock.now += 2.0
    assert stats.snapshot(0)["timing/generator/idle_frac"] == pytest.approx(0.0)


def test_the_fleet_sums_throughput_and_averages_idle_fractions_clamping_what_generators_claim():
    reports = [{"perf/generator/tokens_per_s": 10.0, "timing/generator/idle_frac": 0.2},
               {"perf/generator/tokens_per_s": 5.0, "timing/generator/idle_frac": 7.0},  # hostile: counts as 1
               {"perf/generator/tokens_per_s": 1.0}]  # an older generator that does not report it
    out = fleet_metrics(reports)
    assert out["perf/generator/tokens_per_s"] == 16.0
    assert out["timing/generator/idle_frac"] == pytest.approx(0.6)
    assert fleet_metrics([]) == {"perf/generator/tokens_per_s": 0.0}  # no report: no made-up idle fraction


def test_the_fleet_counts_every_sampled_token_and_busy_second_so_a_rate_survives_windows_that_saw_none(tmp_path):
    """A report's tokens/s is its own window's; a generator waiting for weights whenever the learner logs reports
    0 at every step. The counts since start give its rate while working (scripts/gpu_check.py)."""
    import json

    from scripts.gpu_check import summarize_progress

    clock = FakeClock()
    stats = RolloutStats(clock)
    with stats.busy:
        stats.tokens += 120
        clock.now += 2.0
    first = stats.snapshot(0)
    assert (first["generator/tokens"], first["generator/busy_s"]) == (120.0, 2.0)
    clock.now += 1.0  # idle: this window's rate is 0, the counts stay
    idle = stats.snapshot(1)
    assert idle["perf/generator/tokens_per_s"] == 0.0 and (idle["generator/tokens"], idle["generator/busy_s"]) == (
        120.0, 2.0)
    fleet = fleet_metrics([idle, {"generator/tokens": 30.0, "generator/busy_s": 1.0}])
    assert (fleet["generator/tokens"], fleet["generator/busy_s"]) == (150.0, 3.0)
    rows = [{"step": 1, "perf/generator/tokens_per_s": 0.0, "generator/tokens": 100.0, "generator/busy_s": 2.0},
            {"step": 2, "perf/generator/tokens_per_s": 0.0, "generator/tokens": 300.0, "generator/busy_s": 10.0}]
    progress = tmp_path / "progress.jsonl"
    progress.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summarize_progress(str(progress))["perf/generator/tokens_per_s"] == pytest.approx(30.0)
    progress.write_text(json.dumps({"step": 1, "perf/generator/tokens_per_s": 0.0}) + "\n")  # no count reported
    assert summarize_progress(str(progress))["perf/generator/tokens_per_s"] is None


def test_the_fleet_reports_the_groups_filtered_before_sending_and_leaves_the_sampled_reward_to_the_tally():
    """The sampled reward is the learner's own tally of every group (buffer/sampled.py), attributed to its steps:
    a mean of the generators' report windows would cover other spans and weigh a slow generator like a fast one."""
    reports = [{"reward/mean": 0.2, "generator/filtered_groups": 3.0}, {"reward/mean": 0.6},
               {"perf/generator/tokens_per_s": 1.0}]
    out = fleet_metrics(reports)
    assert out["generator/filtered_groups"] == 3.0 and "reward/sampled_mean" not in out


def test_the_fleet_averages_episode_metrics_and_sums_their_errors_keeping_families_bounded():
    reports = [
        {"rollout/turns/mean": 2.0, "rollout/tool_use_frac": 1.5, "rollout/tool_errors/timeout": 2.0,
         "timing/tool/add_s": 0.1, "rollout/resumed_turns": 3.0, "generator/reward_errors": 1.0},
        {"rollout/turns/mean": 4.0, "rollout/tool_use_frac": 0.5, "rollout/tool_errors/timeout": 1.0,
         "rollout/tool_errors/error": 5.0, "timing/tool/add_s": 0.3, "rollout/env_errors/bad_result": 1.0,
         **{f"rollout/tool_errors/junk{index:03d}": 1.0 for index in range(100)},
         **{f"timing/tool/t{index:03d}_s": 1.0 for index in range(100)}, "timing/tool/" + "x" * 300: 1.0},
    ]
    out = fleet_metrics(reports)
    assert out["rollout/turns/mean"] == 3.0 and out["rollout/tool_use_frac"] == 0.75  # 1.5 is clamped to 1 first
    assert out["rollout/tool_errors/timeout"] == 3.0 and out["rollout/tool_errors/error"] == 5.0
    assert abs(out["timing/tool/add_s"] - 0.2) < 1e-12 and out["rollout/resumed_turns"] == 3.0
    assert out["rollout/env_errors/bad_result"] == 1.0 and out["generator/reward_errors"] == 1.0
    assert not any("junk" in key for key in out)  # only the reasons the generator has
    assert len([key for key in out if key.startswith("timing/tool/")]) == 16
    assert not any(len(key) > 100 for key in out)


def test_the_fleet_knows_every_error_reason_the_generator_counts():
    """The reasons written in generator/ appear in ERROR_REASONS (else the learner would drop them)."""
    import os
    import re

    from asyncrl.buffer.fleet_stats import ERROR_REASONS

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sources = {name: open(os.path.join(root, "generator", name)).read()
               for name in ("agents/tools.py", "agents/episode.py", "agents/openai_agent.py")}
    tool = set(re.findall(r'self\.failed\("([a-z_]+)"', sources["agents/tools.py"]))
    tool |= {"malformed", "unknown_tool", "bad_arguments"}  # the parser's, through rejected()
    env = set(re.findall(r'_failed\("([a-z_]+)"', sources["agents/episode.py"]))
    from asyncrl.generator.agents.openai_agent import AGENT_FAILURES
    from asyncrl.generator.agents.openai_session import REFUSAL_CAUSES

    env |= set(re.findall(r'failure = "([a-z_]+)"', sources["agents/openai_agent.py"])) | set(AGENT_FAILURES)
    assert set(re.findall(r'return "(agent_[a-z_]+)"', sources["agents/openai_agent.py"])) <= set(AGENT_FAILURES)
    assert set(REFUSAL_CAUSES) == set(ERROR_REASONS["rollout/http_refusals/"])
    env |= set(re.findall(r'env_errors\["([a-z_]+)"\]', open(os.path.join(root, "generator", "sampling.py")).read()))
    assert tool and env
    assert tool <= set(ERROR_REASONS["rollout/tool_errors/"]), tool
    assert env <= set(ERROR_REASONS["rollout/env_errors/"]), env
    # the scorer's three (tests/unit/test_scoring.py provokes each)
    assert {"timeout", "error", "bad_value"} <= set(ERROR_REASONS["generator/reward_errors/"])
