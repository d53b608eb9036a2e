"""What a job evaluates on while training, and the name it goes by (launch/cli.py::training_eval_prompts): the
user's eval.files, data.val_fraction's split of their training data (held out of what the learner deals), or
nothing, said once; never the demo's held-out split for a job that brings its own model and data. The demo's model
stands in for the user's (its tokenizer renders the prompts)."""
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.configs import load_config
from asyncrl.data.prompts import DatasetError
from asyncrl.launch.cli import load_learner_prompts


@pytest.fixture
def own_job(tmp_path, demo_assets):
    """The user's model (the demo's, copied in spirit) and 40 rows of their own data source."""
    model_dir, (train_file, *_) = demo_assets
    rows = pq.read_table(train_file).to_pylist()[:40]
    for row in rows:
        row["data_source"] = "my_task"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:8]), tmp_path / "test.parquet")
    base = [f"model.path={model_dir}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"demo.cache_dir={tmp_path / 'demo'}", "eval.every_steps=10"]  # the default recipe: demo.task is set
    return model_dir, [str(tmp_path / "train.parquet")], base


def learner_prompts(model_dir, files, overrides):
    return load_learner_prompts(load_config(None, overrides), model_dir, files)


def test_eval_files_are_evaluated_and_named(own_job, tmp_path):
    model_dir, files, base = own_job
    prompts, evals = learner_prompts(model_dir, files, [*base, f"eval.files=[{tmp_path / 'test.parquet'}]"])
    assert len(prompts.rows) == 40 and len(evals.rows) == 8 and evals.source == "eval.files: test.parquet"
    assert {row.data_source for row in evals.rows} == {"my_task"}


def test_a_held_out_split_is_evaluated_and_never_trained_on(own_job, caplog):
    caplog.set_level(logging.INFO)
    model_dir, files, base = own_job
    prompts, evals = learner_prompts(model_dir, files, [*base, "data.val_fraction=0.1"])
    assert len(evals.rows) == 4 and len(prompts.rows) == 36
    assert not {row.prompt_id for row in prompts.rows} & {row.prompt_id for row in evals.rows}
    assert evals.source == "the 10% held-out split of train.parquet"
    assert ("eval: 4 prompts held out (the 10% held-out split of train.parquet, data.val_fraction=0.1, seed 0); "
            "training on 36") in caplog.text
    with pytest.raises(DatasetError, match="eval.files and data.val_fraction"):
        learner_prompts(model_dir, files, [*base, "data.val_fraction=0.1", "eval.files=[x.parquet]"])


def test_a_job_with_its_own_data_and_nothing_held_out_evaluates_nothing_and_says_so_once(own_job, caplog, tmp_path):
    caplog.set_level(logging.INFO)
    model_dir, files, base = own_job
    prompts, evals = learner_prompts(model_dir, files, base)
    assert evals is None and len(prompts.rows) == 40
    assert caplog.text.count("no evaluation while training") == 1, caplog.text
    assert not (tmp_path / "demo").exists()  # the recipe's demo.task built nothing
