"""data/split.py and data.val_fraction (data/prompts.py::split_job_rows): the rows held out of training are a pure
function of the files, the fraction and the seed, disjoint from the rows trained on, at least one and never all."""
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.configs import load_config
from asyncrl.data.prompts import DatasetError, describe_split, job_rows, split_job_rows
from asyncrl.data.split import SplitError, held_out_indexes, split_held_out


def test_the_split_is_seeded_disjoint_and_counts_round_the_fraction():
    items = list(range(200))
    kept, held = split_held_out(items, 0.1, seed=0, salt="s")
    assert len(held) == 20 and len(kept) == 180 and not set(kept) & set(held) and sorted(kept + held) == items
    assert kept == sorted(kept) and held == sorted(held)  # each in the data's order
    assert split_held_out(items, 0.1, seed=0, salt="s") == (kept, held)
    assert split_held_out(items, 0.1, seed=1, salt="s")[1] != held  # another seed, another split
    assert split_held_out(items, 0.1, seed=0, salt="other")[1] != held  # and another salt (sft's, data's)
    assert split_held_out(items, 0.0, seed=0, salt="s") == (items, [])
    assert len(held_out_indexes(10, 0.01, seed=0, salt="s")) == 1  # at least one row when asked for any


@pytest.mark.parametrize("count, fraction", [(1, 0.5), (3, 0.9), (10, 1.0), (10, -0.1)])
def test_a_split_that_leaves_nothing_to_train_on_or_is_no_fraction_is_refused(count, fraction):
    with pytest.raises(SplitError):
        held_out_indexes(count, fraction, seed=0, salt="s")


def test_every_process_holds_out_the_same_rows():
    """Nothing in it depends on the process (hash randomisation, import order): another interpreter agrees."""
    code = ("from asyncrl.data.split import held_out_indexes; "
            "print(sorted(held_out_indexes(1000, 0.05, seed=7, salt='data-val')))")
    outputs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(h)},
                              capture_output=True, text=True, check=True).stdout for h in (1, 2)}
    assert outputs == {str(sorted(held_out_indexes(1000, 0.05, seed=7, salt="data-val"))) + "\n"}


def write_rows(path, count):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "mine",
             "reward_model": {"ground_truth": str(i)}} for i in range(count)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_the_job_rows_trained_on_leave_out_the_held_out_ones(tmp_path):
    write_rows(tmp_path / "train.parquet", 50)
    files = [str(tmp_path / "train.parquet")]
    data = load_config(None, ["data.val_fraction=0.1"]).data
    train, held = split_job_rows(data, 0, files)
    ids = lambda rows: [row["_id"] for row in rows]  # noqa: E731
    assert len(held) == 5 and len(train) == 45 and not set(ids(train)) & set(ids(held))
    assert ids(job_rows(data, 0, files)) == ids(train)  # what the learner deals and a generator walks
    assert ids(split_job_rows(data, 0, files)[1]) == ids(held) != ids(split_job_rows(data, 1, files)[1])
    off = load_config(None, []).data
    assert len(job_rows(off, 0, files)) == 50 and split_job_rows(off, 0, files)[1] == []
    assert describe_split(data, files) == "the 10% held-out split of train.parquet"
    write_rows(tmp_path / "one.parquet", 1)
    with pytest.raises(DatasetError, match="data.val_fraction=0.1"):
        split_job_rows(data, 0, [str(tmp_path / "one.parquet")])


def test_data_val_fraction_must_be_a_fraction():
    from asyncrl.configs import ConfigError

    with pytest.raises(ConfigError, match="data.val_fraction"):
        load_config(None, ["data.val_fraction=1.0"])
