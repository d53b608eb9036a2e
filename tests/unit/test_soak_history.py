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
    """The dealer's cursor stood at 2.5 epochs: every prompt was dealt 2 or 3 times, so 4 trainings is a duplicate
    and none at all is a loss (one deal out costs one training, not two)."""
    groups = [row(1, [DATA[0], DATA[0]]), row(2, [DATA[0], DATA[1]]), row(3, [DATA[2], DATA[0]])]
    cursor = [{**row, "data/epoch": 2.5} for row in progress([0.1, 0.2, 0.3])]
    report = check_history(groups, cursor, DATA, max_staleness=1, window=1)
    assert report.epochs == 2 and report.lost == ["d.parquet:3 x0"] and report.duplicated == ["d.parquet:0 x4"]
    # a prompt the generators' filter dropped was consumed without being trained: not lost
    report = check_history(groups[1:], cursor[1:], DATA, max_staleness=1, consumed_elsewhere=Counter({DATA[3]: 1}),
                           window=1)
    assert report.lost == [] and report.duplicated == [] and report.problems() == []


def test_records_without_generators_or_staleness_fail_rather_than_pass():
    groups = [{"step": 1, "groups": ["g"], "prompts": [DATA[0]]}]
    report = check_history(groups, progress([0.1, 0.2]), DATA[:1], max_staleness=1, window=1)
    assert not report.groups_recorded and any("could not run" in p for p in report.problems())


def test_the_dealers_cursor_bounds_each_prompt_however_many_deals_are_out():
    """The dealer stood 2.5 epochs into the data, as the soak in CI found it at 21 and a bit with many
    prompts out, so the trained groups alone cover fewer epochs than were dealt. A prompt dealt in the current lap
    is one ahead of those not yet dealt in it, and one whose deal is out is one behind: both hold. Two behind is
    lost; one more than the cursor dealt is duplicated."""
    groups = [row(1, DATA[:2]), row(2, DATA[2:]), row(3, DATA[:2]), row(4, DATA[2:]), row(5, DATA[:1])]
    # dealt: d0 and d1 three times (the current lap), d2 and d3 twice; d1's third deal is still out
    stopped = [{"step": 1, "reward/sampled_mean": 0.1}, {"step": 5, "reward/sampled_mean": 0.5, "data/epoch": 2.5}]
    report = check_history(groups, stopped, DATA, max_staleness=1, window=1)
    assert report.problems() == [] and report.epochs == 2
    ahead = groups + [row(6, [DATA[0]])]  # d0 a fourth time: more than the cursor ever dealt it
    assert check_history(ahead, stopped, DATA, max_staleness=1, window=1).duplicated == ["d.parquet:0 x4"]
    later = [stopped[0], {**stopped[1], "data/epoch": 4.5}]  # d1, d2, d3 dealt 4 times or more, trained twice
    assert check_history(groups, later, DATA, max_staleness=1, window=1).lost == [f"{p} x2" for p in DATA[1:]]


def test_each_generator_must_end_within_eta_of_the_last_published_version(tmp_path):
    """Read from a real MLflow store, as the generators log into it: two learner lives (a run each); gen-0's last
    report (by time) is v6 of the second life, gen-1's v5, gen-2 stuck on the first life's v9 (past the timeline's
    last step: a version the resumed learner's timeline replaced)."""
    from mlflow.tracking import MlflowClient

    from asyncrl.bench.soak.history import generator_final_versions

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("soak")
    first, second = (client.create_run(experiment).info.run_id for _ in range(2))
    for run, generator, version, at in [(first, "gen-0", 9, 1000), (first, "gen-2", 9, 1003),
                                        (second, "gen-0", 3, 2000), (second, "gen-0", 6, 3000),
                                        (second, "gen-1", 5, 3001), (second, "gen-2", 2, 900)]:
        client.log_metric(run, f"{generator}/generator/version", version, timestamp=at, step=version)
    finals = generator_final_versions(uri, ["gen-0", "gen-1", "gen-2", "gen-3"])
    assert finals == {"gen-0": 6, "gen-1": 5, "gen-2": 9}
    groups = [row(step, [DATA[step % 4]]) for step in range(1, 7)]
    report = check_history(groups, progress([0.1] * 3 + [0.5] * 3), DATA, max_staleness=1, window=3,
                           final_versions=finals, generators=["gen-0", "gen-1", "gen-2", "gen-3"])
    assert report.last_step == 6 and report.versions == [
        "gen-3 reported no version", "gen-2 ended on v9, the learner's last published version is v6 (η 1)"]
    assert any(problem.startswith("generator versions") for problem in report.problems())
    held = check_history(groups, progress([0.1] * 3 + [0.5] * 3), DATA, max_staleness=1, window=3,
                         final_versions={"gen-0": 6, "gen-1": 5}, generators=["gen-0", "gen-1"])
    assert held.versions == []
