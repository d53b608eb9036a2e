"""The soak's history checker (bench/soak/history.py) on hand-written records: a clean history with a learner
restart holds; each invariant it guards is broken once and named."""
from collections import Counter

from asyncrl.bench.soak.history import check_history, effective_timeline, learner_lives

DATA = [f"d.parquet:{i}" for i in range(4)]


def row(step, prompts, generators=None, staleness=None):
    generators = generators or ["a"] * len(prompts)
    return {"step": step, "groups": [f"g{step}-{p}" for p in prompts], "prompts": prompts,
            "generators": generators, "staleness": staleness or [0] * len(prompts)}


def progress(rewards):
    return [{"step": step, "reward/sampled_mean": reward} for step, reward in enumerate(rewards, 1)]


def clean_history():
    """Two epochs of 4 prompts, 2 a step; the learner died after step 3 and resumed from its step-2 checkpoint,
    so the second life trained steps 3 and 4 again (the first life's step 3 is replaced)."""
    return [row(1, DATA[:2]), row(2, DATA[2:]), row(3, ["d.parquet:0", "d.parquet:0"]),
            row(3, [DATA[1], DATA[0]]), row(4, [DATA[3], DATA[2]], staleness=[1, 1])]


def test_a_clean_history_with_a_restart_holds():
    groups = clean_history()
    assert learner_lives(groups) == [(1, 3), (3, 4)]
    assert [r["prompts"] for r in effective_timeline(groups).values()][2] == [DATA[1], DATA[0]]
    report = check_history(groups, progress([0.1, 0.2, 0.5, 0.6]), DATA, max_staleness=1, window=2)
    assert report.problems() == [] and report.epochs == 2 and report.steps == 4 and report.groups == 8


def test_each_broken_invariant_is_named():
    groups = clean_history()[:-1] + [row(6, [DATA[3], "other:9"], generators=["a", "rogue"], staleness=[3, 0])]
    report = check_history(groups, progress([0.5, 0.4]), DATA, max_staleness=1, hostile={"rogue"}, window=1)
    problems = " | ".join(report.problems())
    assert report.epochs == 1 and report.lost == report.duplicated == []  # 7 of the data's prompts trained: epoch 2 open
    assert report.foreign == ["other:9 x1"] and "foreign" in problems
    assert report.stale == ["step 6: group g6-d.parquet:3 from a at staleness 3 > 1"]
    assert report.hostile_trained == ["step 6: group g6-other:9 from hostile generator rogue"]
    assert report.gaps == ["step 3 is followed by step 6"] and "did not rise" in problems


def test_lost_and_duplicated_prompts_and_prompts_consumed_elsewhere():
    groups = [row(1, [DATA[0], DATA[0]]), row(2, [DATA[0], DATA[1]]), row(3, [DATA[2], DATA[0]])]
    report = check_history(groups, progress([0.1, 0.2, 0.3]), DATA, max_staleness=1, window=1)
    assert report.epochs == 1 and report.lost == ["d.parquet:3 x0"] and report.duplicated == ["d.parquet:0 x4"]
    # a prompt the generators' filter dropped was consumed without being trained: not lost
    report = check_history(groups[1:], progress([0.1, 0.2]), DATA, max_staleness=1,
                           consumed_elsewhere=Counter({DATA[3]: 1}), window=1)
    assert report.lost == [] and report.duplicated == [] and report.problems() == []


def test_records_without_generators_or_staleness_fail_rather_than_pass():
    groups = [{"step": 1, "groups": ["g"], "prompts": [DATA[0]]}]
    report = check_history(groups, progress([0.1, 0.2]), DATA[:1], max_staleness=1, window=1)
    assert not report.groups_recorded and any("could not run" in p for p in report.problems())


def test_a_prompt_still_out_when_the_job_stopped_may_be_one_training_behind():
    """Three epochs' worth trained (d:0 already into its fourth), but d:3's third deal was out when the job
    stopped (data/out 1): one behind is allowed for as many prompts as were out, not more."""
    groups = [row(1, DATA[:2]), row(2, DATA[2:]), row(3, DATA[:2]), row(4, DATA[2:]), row(5, DATA[:3]),
              row(6, DATA[:1])]
    out = [{"step": 1, "reward/sampled_mean": 0.1}, {"step": 6, "reward/sampled_mean": 0.5, "data/out": 1}]
    assert check_history(groups, out, DATA, max_staleness=1, window=1).problems() == []
    stopped = [out[0], {**out[1], "data/out": 0}]
    assert check_history(groups, stopped, DATA, max_staleness=1, window=1).lost == ["d.parquet:3 x2"]
