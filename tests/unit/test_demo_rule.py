"""Whether the demo runs (configs/sections.py::demo_active), and what a job that brings its own model or data gets
instead of the demo's assets: its own inputs, one line saying the recipe's demo.task is off, or an error naming the
key it lacks (launch/job.py::resolve_rl_inputs / resolve_sft_inputs). No demo asset is built for such a job."""
import pytest

from asyncrl.configs import load_config
from asyncrl.configs.sections import demo_active, demo_off_note, part_seed
from asyncrl.launch.job import JobInputsError, resolve_rl_inputs, resolve_sft_inputs


def config(tmp_path, *overrides):
    """The default recipe (demo.task=sort_digits), its demo cache in tmp_path/demo: built only if the demo runs."""
    return load_config(None, [f"demo.cache_dir={tmp_path / 'demo'}", *overrides])


@pytest.mark.parametrize("overrides, active, keys", [
    ((), True, None),
    (("model.path=m",), False, "model.path"),
    (("data.train_files=[t.parquet]",), False, "data.train_files"),
    (("data.source=reasoning_gym", "data.reasoning_gym_tasks=[basic_arithmetic]"), False, "data.source=reasoning_gym"),
    (("model.path=m", "data.train_files=[t.parquet]"), False, "model.path, data.train_files"),
    (("demo.task=''",), False, None),
    (("demo.task=''", "model.path=m"), False, None),
])
def test_the_demo_runs_only_for_a_job_without_a_model_or_data_of_its_own(tmp_path, overrides, active, keys):
    cfg = config(tmp_path, *overrides)
    assert demo_active(cfg.demo, cfg.model, cfg.data) is active
    note = demo_off_note(cfg.demo, cfg.model, cfg.data)
    if keys is None:
        assert note is None
    else:
        assert note == f"demo.task=sort_digits is off: this job brings its own model/data ({keys})"


def test_a_job_with_its_own_model_and_data_gets_them_and_no_demo_asset(tmp_path):
    said = []
    cfg = config(tmp_path, f"model.path={tmp_path}", "data.train_files=[t.parquet]")
    assert resolve_rl_inputs(cfg, say=said.append) == (str(tmp_path), ["t.parquet"])
    assert resolve_sft_inputs(cfg, say=said.append) == (str(tmp_path), ["t.parquet"])
    assert said == ["demo.task=sort_digits is off: this job brings its own model/data (model.path, "
                    "data.train_files)"] * 2  # once per command
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("overrides, key", [
    (("data.train_files=[t.parquet]",), "model.path is not set (this job brings its own data (data.train_files)"),
    (("model.path=m",), "data.train_files is empty"),  # the recipe's demo prompts went with its demo
    (("demo.task=''",), "model.path is not set (and demo.task is off)"),
])
def test_a_job_missing_its_model_or_data_is_told_which_key(tmp_path, overrides, key):
    cfg = config(tmp_path, *overrides)
    with pytest.raises(JobInputsError) as err:
        resolve_rl_inputs(cfg, say=lambda line: None)
    assert key in str(err.value) and "e.g." in str(err.value)
    with pytest.raises(JobInputsError, match="model.path|data.train_files"):
        resolve_sft_inputs(cfg, say=lambda line: None)
    assert not (tmp_path / "demo").exists()


def test_a_bare_learner_may_go_without_data_but_asyncrl_run_may_not(tmp_path):
    """Scripted generators bring their own groups (tests/e2e/test_resume.py); real ones need prompts."""
    cfg = config(tmp_path, "demo.task=''", "model.path=m")
    assert resolve_rl_inputs(cfg, say=lambda line: None) == ("m", [])
    with pytest.raises(JobInputsError, match="data.train_files"):
        resolve_rl_inputs(cfg, say=lambda line: None, require_data=True)


def test_the_eval_files_of_a_job_with_its_own_data_are_never_the_demos(tmp_path):
    from asyncrl.launch.cli import eval_files

    assert eval_files(config(tmp_path, "model.path=m", "data.train_files=[t.parquet]")) is None
    assert eval_files(config(tmp_path, "model.path=m", "eval.files=[e.parquet]")) == ["e.parquet"]
    assert not (tmp_path / "demo").exists()
    demo = eval_files(config(tmp_path))
    assert len(demo) == 1 and demo[0].startswith(str(tmp_path / "demo" / "sort_digits-"))


def test_part_seeds_follow_job_seed_unless_set():
    cfg = load_config(None, ["job.seed=5", "generator.seed=9"])
    assert (cfg.learner.seed, cfg.sft.seed, cfg.data.seed) == (None, None, None)
    assert part_seed(cfg.learner.seed, cfg.job.seed) == 5 and part_seed(cfg.generator.seed, cfg.job.seed) == 9
    assert part_seed(0, 5) == 0  # an explicit 0 is a seed, not "unset"
