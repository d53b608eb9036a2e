"""asyncrl plan: the simulator keeps asyncrl's staleness bound, reproduces Applied Compute's closed form in that
model's setting, reads a finished job's inputs, and the command answers how many generators a learner needs."""
import json
import subprocess
import sys

import pytest

from asyncrl.planner.closed_form import in_queue_staleness, mean_staleness, pre_queue_staleness, tailness
from asyncrl.planner.from_run import empirical_lengths, lognormal_lengths, measure_run
from asyncrl.planner.simulate import Fleet, Learner, Queue, simulate
from tests.planner_jobs import write_job


def test_the_closed_form_gives_the_published_worked_values():
    # two cases a public implementation of the post tests (docs/planner.md): train-bound and rollout-bound
    assert pre_queue_staleness(4, 4, 2.0, 1.4) == pytest.approx(0.7)
    assert in_queue_staleness(2.0, 1) == pytest.approx(0.75)
    assert mean_staleness(4, 4, 2.0, 1.4, 1) == pytest.approx(1.45)
    assert mean_staleness(4, 8, 0.5, 2.0, 1) == pytest.approx(1.5)
    assert tailness([[1, 3], [2, 2]]) == pytest.approx(2.5 / 2)
    with pytest.raises(ValueError):
        mean_staleness(4, 8, 0.0, 2.0, 1)


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_no_simulated_group_is_trained_older_than_eta_and_eta_0_is_on_policy(eta):
    lengths = lognormal_lengths(20, 0.8)
    result = simulate(Fleet(generators=2, slots=4, n=4, gen_tokens_per_s=400), Learner(groups_per_step=4,
                      max_staleness=eta, train_s_per_step=0.3), Queue(), lengths, steps=60, seed=1, warmup_steps=5)
    assert result.steps == 60 and result.trained_groups == 240
    assert max(result.staleness) <= eta
    if eta == 0:
        assert set(result.staleness) == {0} and result.learner_idle_frac > 0.1  # it waits for every batch
    assert 0 <= result.generator_idle_frac <= 1 and 0 <= result.learner_idle_frac <= 1


def test_more_generators_help_a_starved_learner_until_the_learner_is_the_bottleneck():
    lengths = lognormal_lengths(20, 0.5)
    rates = [simulate(Fleet(generators=g, slots=4, n=4, gen_tokens_per_s=200),
                      Learner(groups_per_step=8, max_staleness=2, train_s_per_step=0.5), Queue(), lengths, steps=80,
                      warmup_steps=8).steps_per_s for g in (1, 2, 4, 16)]
    assert rates[0] < rates[1] < rates[2]
    assert rates[3] == pytest.approx(2.0, rel=0.02)  # 1 / train_s: the learner never waits


def test_filtered_groups_give_their_admission_back_and_cost_an_on_policy_learner_another_round():
    """Dynamic sampling drops a group whose rewards are all equal and gives its admission back: at eta = 0 the
    batch waits for the replacements (another round of sampling), so the learner waits longer; every trained group
    is still on-policy, and about filter_frac of the finished groups are dropped."""
    lengths = lognormal_lengths(20, 0.5)
    runs = {frac: simulate(Fleet(generators=2, slots=8, n=4, gen_tokens_per_s=400, filter_frac=frac),
                           Learner(groups_per_step=8, max_staleness=0, train_s_per_step=0.3), Queue(), lengths,
                           steps=80, seed=2, warmup_steps=8) for frac in (0.0, 0.3)}
    assert runs[0.0].filtered == 0
    kept = runs[0.3]
    assert set(kept.staleness) == {0} and kept.trained_groups == 640
    assert kept.filtered / (kept.filtered + kept.produced_groups) == pytest.approx(0.3, abs=0.05)
    assert kept.steps_per_s < 0.9 * runs[0.0].steps_per_s and kept.learner_idle_frac > runs[0.0].learner_idle_frac


def test_the_simulator_reproduces_the_closed_form_in_its_setting():
    from asyncrl.bench.plan_check import closed_form_point

    for rho, q in ((0.5, 1), (2.0, 2)):
        point = closed_form_point(64, 16, 4, rho, q, 0.6, steps=150, seed=0)
        assert abs(point["error"]) < 0.15, point


def test_a_finished_job_gives_the_planners_inputs(tmp_path):
    measured = measure_run(str(write_job(tmp_path / "job")))
    assert measured.generators == 2 and measured.groups_per_step == 4 and measured.n == 4
    assert measured.gen_tokens_per_s == pytest.approx(300 / 2 / 0.75)  # busy rate of one generator
    assert measured.train_s_per_step == pytest.approx(1.5) and measured.steps_per_s == pytest.approx(0.5)
    import random

    assert empirical_lengths(measured.lengths)(random.Random(0), 4) == [10, 20, 30, 40]  # a whole measured group
    assert measured.filter_frac == 0.0
    assert measure_run(str(write_job(tmp_path / "filtering", filtered_per_step=1))).filter_frac == pytest.approx(0.2)
    # the count comes from the generators' reports: an absurd one is refused, not planned with for hours
    with pytest.raises(ValueError, match="reported .* filtered"):
        measure_run(str(write_job(tmp_path / "lying", filtered_per_step=10**9)))
    with pytest.raises(ValueError, match="filter_frac"):
        simulate(Fleet(filter_frac=1.0), Learner(), Queue(), lognormal_lengths(20, 0.5), steps=5)
    with pytest.raises(ValueError, match="not a finished"):
        measure_run(str(tmp_path))


def test_asyncrl_plan_sizes_the_fleet_and_checks_itself_against_the_run(tmp_path):
    job = write_job(tmp_path / "job")
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "plan", "--from-run", str(job),
                          "--generators", "1", "2", "4", "--etas", "0", "1", "--steps", "60"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["plans"]) == 6 and set(result["enough_generators"]) == {"0", "1"}
    assert result["check"]["measured_steps_per_s"] == pytest.approx(0.5)
    assert "this learner needs" in out.stdout and "check against the run" in out.stdout
    refused = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "plan", "--train-s", "1"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--gen-tokens-per-s" in refused.stderr
    bad_share = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "plan", "--gen-tokens-per-s", "100",
                                "--train-s", "1", "--mean-len", "10", "--filter-frac", "1.5"],
                               capture_output=True, text=True, timeout=120)
    assert bad_share.returncode == 2 and "--filter-frac" in bad_share.stderr
    no_fleet = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "plan", "--from-run", str(job),
                               "--generators", "0"], capture_output=True, text=True, timeout=120)
    assert no_fleet.returncode == 2 and ">= 1" in no_fleet.stderr


def test_the_run_script_parses_and_asks_for_its_directory():
    """bench/plan_runs.sh makes docs/benchmarks.md's measured runs (minutes of `asyncrl run`, not run here): it must at least
    parse, and without a directory say how it is used instead of writing runs somewhere."""
    import os

    script = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "plan_runs.sh")
    assert subprocess.run(["bash", "-n", script], capture_output=True, timeout=30).returncode == 0
    out = subprocess.run(["bash", script], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "usage: bash bench/plan_runs.sh OUT_DIR" in out.stderr
