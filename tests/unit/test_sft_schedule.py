"""The SFT job's data walk and splits (learner/sft.py, learner/sft_job.py): each example once per epoch in a seeded
order, the same batches for a resumed job, a seeded validation split, and the config's refusals."""
import pytest

from asyncrl.learner.config import SFTConfig
from asyncrl.learner.sft import batch_for_step, epoch_batches
from asyncrl.data.sft import SFTDataError
from asyncrl.learner.sft_job import split_validation, total_steps


def test_each_epoch_covers_every_example_once_in_its_own_seeded_order():
    batches = epoch_batches(10, 4, epoch=0, seed=3)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert epoch_batches(10, 4, epoch=0, seed=3) == batches  # the same order for the same (seed, epoch)
    assert epoch_batches(10, 4, epoch=1, seed=3) != batches


def test_a_step_names_its_batch_so_a_resumed_job_draws_the_same_data():
    walk = [batch_for_step(step, 10, 4, seed=3, epochs=2) for step in range(6)]
    assert [epoch for epoch, _ in walk] == [0, 0, 0, 1, 1, 1]
    assert [b for _, b in walk[:3]] == epoch_batches(10, 4, 0, 3) and [b for _, b in walk[3:]] == epoch_batches(
        10, 4, 1, 3)
    assert batch_for_step(7, 10, 4, seed=3, epochs=0) == batch_for_step(7, 10, 4, seed=3, epochs=0)
    assert len(batch_for_step(7, 10, 4, seed=3, epochs=0)[1]) == 4
    assert total_steps(SFTConfig(epochs=2, batch_size=4), 10) == 6
    assert total_steps(SFTConfig(steps=7), 10) == 7


def test_the_validation_split_is_seeded_and_never_takes_everything():
    examples = list(range(20))
    train, val = split_validation(examples, 0.25, seed=1)
    assert len(val) == 5 and sorted(train + val) == examples
    assert split_validation(examples, 0.25, seed=1) == (train, val)
    assert split_validation(examples, 0.0, seed=1) == (examples, [])
    with pytest.raises(SFTDataError, match="sft.val_fraction=0.5: .*leaves nothing to train on"):
        split_validation([1], 0.5, seed=1)


@pytest.mark.parametrize("kwargs, match", [({"lr_schedule": "step"}, "lr_schedule"),
                                           ({"min_lr_ratio": 0.5}, "does not decay"),
                                           ({"val_fraction": 1.0}, "val_fraction"),
                                           ({"val_files": ["v.parquet"], "val_fraction": 0.1}, "keep one"),
                                           ({"epochs": -1}, "must be >= 0"),
                                           ({"torch_threads": -1}, "sft.torch_threads must be >= 0")])
def test_sft_settings_that_do_not_combine_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SFTConfig(**kwargs)
