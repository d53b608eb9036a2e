"""The suite runner's maths (bench/time_to_reward.py) and the judge's reading of `asyncrl eval` (bench/judge.py):
pure functions, no runs."""
import json
import os

import pytest

from asyncrl.bench.judge import JUDGE_ENGINE, eval_command, parse_eval_output, scores_from
from asyncrl.bench.suite.task import SuiteTask
from asyncrl.bench.time_to_reward import (DEFAULT, ETA0, TRL, fill_budget, heldout_columns, plan_runs, ratio,
                                          steps_to_target, summary_rows, sync_threads, time_to_target)
from asyncrl.bench.trl_grpo import trl_lr_schedule, unsupported_reason
from asyncrl.configs import load_config

TASK = SuiteTask(name="t", recipe="demo_cpu.yaml", overrides=("rollout.max_tokens=12",), test_files=("t.parquet",),
                 target=0.5, steps=10)


def test_parse_eval_output_reads_the_last_json_line_after_the_table():
    metrics = {"eval/all/mean_reward": 0.5, "eval/all/pass_at_1": 0.25, "eval/all/prompts": 4.0}
    stdout = "eval: on eval.files (4 prompts)\neval: 4/4 prompts\ndata_source  mean_reward\nall  0.5\n" + \
        json.dumps(metrics) + "\n"
    assert parse_eval_output(stdout) == metrics


def test_parse_eval_output_names_what_it_got_when_there_is_no_metrics_line():
    with pytest.raises(ValueError, match="no JSON line.*crashed"):
        parse_eval_output("eval: on eval.files\ncrashed\n")
    with pytest.raises(ValueError, match="does not parse"):
        parse_eval_output('table\n{"eval/all/mean_reward": 0.5\n')


def test_scores_come_from_the_greedy_and_the_sampled_runs():
    greedy = {"eval/all/prompts": 4.0, "eval/all/mean_reward": 0.75, "eval/all/pass_at_1": 0.5}
    sampled = {"eval/all/prompts": 4.0, "eval/all/mean_reward": 0.4, "eval/all/pass_at_1": 0.3,
               "eval/all/pass_at_4": 0.7}
    assert scores_from(greedy, sampled, (1, 4)) == {"prompts": 4, "greedy_reward": 0.75, "greedy_pass": 0.5,
                                                    "t1_reward": 0.4, "pass_at_1": 0.3, "pass_at_4": 0.7}
    episodes = {**sampled, "eval/all/tool_use": 0.9}  # asyncrl eval on a multi-turn task
    assert scores_from(greedy, episodes, (1, 4))["t1_tool_use"] == 0.9


def test_the_judges_engine_comes_after_every_override_and_the_files_last():
    command = eval_command("model", TASK, ["a.parquet"], ["eval.n=2"], ("generator.engine=vllm",))
    engine = command.index(JUDGE_ENGINE[0])
    assert command.index("rollout.max_tokens=12") < command.index("generator.engine=vllm") < engine
    assert command[-4:] == ["--checkpoint", "model", "--files", "a.parquet"]


def test_multi_turn_tasks_are_not_run_on_trl():
    assert "calculator" in unsupported_reason(load_config("tools_cpu.yaml", []))
    assert unsupported_reason(load_config("demo_cpu.yaml", [])) is None


def test_trl_gets_the_recipes_lr_schedule_and_a_schedule_it_has_no_match_for_is_refused():
    from asyncrl.learner.config import LearnerConfig

    assert trl_lr_schedule(LearnerConfig()) == {"lr_scheduler_type": "constant_with_warmup"}
    assert trl_lr_schedule(LearnerConfig(lr_schedule="cosine")) == {"lr_scheduler_type": "cosine"}
    assert trl_lr_schedule(LearnerConfig(lr_schedule="cosine", min_lr_ratio=0.1)) == {
        "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}
    assert trl_lr_schedule(LearnerConfig(lr_schedule="linear")) == {"lr_scheduler_type": "linear"}
    with pytest.raises(SystemExit, match="no linear decay to a floor"):
        trl_lr_schedule(LearnerConfig(lr_schedule="linear", min_lr_ratio=0.1))


def test_ratio_and_the_summary_over_tasks():
    assert ratio(50.0, 100.0) == 0.5 and ratio(None, 100.0) is None and ratio(50.0, None) is None
    assert ratio(50.0, 0.0) is None
    medians = {"a": {DEFAULT: {"time_to_target_s": 30.0, "heldout_greedy_reward": 0.8},
                     TRL: {"time_to_target_s": 60.0, "heldout_greedy_reward": 0.7},
                     ETA0: {"time_to_target_s": 100.0, "heldout_greedy_reward": 0.79}},
               "b": {DEFAULT: {"time_to_target_s": 40.0, "heldout_greedy_reward": 0.5},
                     TRL: {"time_to_target_s": 50.0, "heldout_greedy_reward": 0.6},
                     ETA0: {"time_to_target_s": None, "heldout_greedy_reward": 0.4}},
               "c": {DEFAULT: {"time_to_target_s": 10.0}, TRL: {"time_to_target_s": 40.0}}}
    a, b, c, overall = summary_rows(medians)
    assert (a["ttt_default_over_trl"], a["ttt_default_over_eta0"]) == (0.5, 0.3)
    assert b["ttt_default_over_eta0"] is None and b["heldout_trl"] == 0.6 and c["heldout_eta0"] is None
    assert overall["task"] == "median over 3 tasks"
    assert overall["ttt_default_over_trl"] == 0.5  # of 0.5, 0.8 and 0.25
    assert overall["ttt_default_over_eta0"] == 0.3  # the one task that has it
    assert overall["heldout_default"] == pytest.approx(0.65)


def test_time_and_steps_to_target_count_only_full_windows():
    elapsed, rewards = [5.0, 6.0, 8.0, 11.0, 15.0], [0.9, 0.1, 0.5, 0.7, 0.9]
    assert steps_to_target(rewards, 0.55, 2) == 4 and time_to_target(elapsed, rewards, 0.55, 2) == 6.0
    assert steps_to_target(rewards, 0.9, 1) == 1  # a full window of one
    assert steps_to_target(rewards, 0.95, 2) is None and time_to_target(elapsed, rewards, 0.95, 2) is None


def test_the_summary_splits_the_time_ratio_into_cost_per_step_and_steps():
    medians = {"a": {DEFAULT: {"time_to_target_s": 60.0, "step_wall_s": 0.5, "steps_to_target": 120},
                     ETA0: {"time_to_target_s": 100.0, "step_wall_s": 1.0, "steps_to_target": 100}}}
    row, overall = summary_rows(medians)
    assert row["wall_default_over_eta0"] == 0.5 and row["steps_default_over_eta0"] == 1.2
    assert overall["steps_default_over_eta0"] == 1.2


def test_eta0_gets_both_sides_threads_and_the_plan_keeps_its_order():
    assert sync_threads(1, 1) == ["learner.torch_threads=2", "generator.torch_threads=2"]
    assert sync_threads(0, 1) == []
    cfg = load_config("demo_cpu.yaml", [])
    plan = plan_runs(cfg, ["default", "eta0", "trl"], [2], [("ppo", ["algo.prox_logprobs=recompute"])])
    assert plan == [(DEFAULT, []), (ETA0, ["buffer.max_staleness=0", "learner.torch_threads=2",
                                           "generator.torch_threads=2"]),
                    ("asyncrl eta=2", ["buffer.max_staleness=2"]), ("asyncrl ppo", ["algo.prox_logprobs=recompute"]),
                    (TRL, None)]


def test_the_default_budget_is_the_shortest_run_so_every_run_is_read_at_a_time_it_reached():
    runs = [{}, {}]
    curves = [([10.0, 11.0, 12.0, 13.0], [0.0, 0.2, 0.4, 0.6]), ([5.0, 7.0, 9.0], [0.1, 0.3, 0.5])]
    assert fill_budget(runs, curves, None, 1) == 3.0
    assert runs[0]["reward_at_budget"] == pytest.approx(0.6) and runs[1]["reward_at_budget"] == pytest.approx(0.3)
    assert fill_budget(runs, curves, 1.5, 2) == 1.5 and runs[0]["reward_at_budget"] == pytest.approx(0.1)


def test_heldout_columns_take_the_largest_k_and_the_tool_use_of_episodes():
    scores = {"prompts": 4, "greedy_reward": 0.75, "greedy_pass": 0.5, "t1_reward": 0.4, "pass_at_1": 0.3,
              "pass_at_4": 0.7}
    columns = heldout_columns(scores, (1, 4))
    assert columns["heldout_pass_at_k"] == 0.7 and columns["heldout_k"] == 4 and columns["heldout_pass_at_1"] == 0.3
    assert "heldout_t1_tool_use" not in columns
    assert heldout_columns({**scores, "t1_tool_use": 0.9}, (1, 4))["heldout_t1_tool_use"] == 0.9


def test_a_suite_cut_short_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """one_run keeps a finished run's numbers and the judge's scores in its job dir: run again, nothing finished
    is trained or judged twice; a run cut short (no trained.json) is emptied and trained again; a judge with
    other settings judges again; a run with other settings is refused rather than read as this one."""
    import argparse

    import asyncrl.bench.judge as judge_module
    import asyncrl.bench.time_to_reward as ttr

    calls = {"train": 0, "judge": 0}

    def fake_train(job_dir, recipe, seed, steps, overrides):
        calls["train"] += 1
        assert not os.path.exists(os.path.join(job_dir, "leftover"))  # a cut-short run's files are gone
        os.makedirs(job_dir, exist_ok=True)
        with open(os.path.join(job_dir, "progress.jsonl"), "w") as handle:
            for step in range(3):
                handle.write(json.dumps({"elapsed_s": 10.0 + step, "reward/sampled_mean": 0.2 * step}) + "\n")

    def fake_judge(model, task, n, ks, overrides, prompts):
        calls["judge"] += 1
        return {"prompts": 4, "greedy_reward": 0.5, "greedy_pass": 0.25, "t1_reward": 0.4 * n, "pass_at_1": 0.4}

    monkeypatch.setattr(ttr, "run_asyncrl", fake_train)
    monkeypatch.setattr(judge_module, "judge", fake_judge)
    setup = {"task": TASK, "steps": 3, "target": 0.3, "overrides": list(TASK.overrides), "samples_per_step": 8,
             "threads": 2}
    args = argparse.Namespace(window=1, final_steps=2, judge_n=1, judge_ks=[1], judge_prompts=0, overrides=[])
    job_dir = str(tmp_path / "sort" / "seed0-asyncrl-default")
    os.makedirs(job_dir)
    open(os.path.join(job_dir, "leftover"), "w").close()

    first, curve = ttr.one_run(setup, DEFAULT, [], 0, job_dir, args)
    assert calls == {"train": 1, "judge": 1} and first["heldout_t1_reward"] == 0.4
    assert first["time_to_target_s"] == 2.0 and first["steps_to_target"] == 3 and curve == ([10.0, 11.0, 12.0], [0.0, 0.2, 0.4])
    second, _ = ttr.one_run(setup, DEFAULT, [], 0, job_dir, args)  # both read back
    assert calls == {"train": 1, "judge": 1} and second == first
    args.judge_n = 2
    third, _ = ttr.one_run(setup, DEFAULT, [], 0, job_dir, args)  # another judge: judged again, not trained
    assert calls == {"train": 1, "judge": 2} and third["heldout_t1_reward"] == 0.8
    with pytest.raises(SystemExit, match="other settings"):
        ttr.one_run({**setup, "steps": 4}, DEFAULT, [], 0, job_dir, args)
