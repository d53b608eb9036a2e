"""A seeded held-out split of a dataset: the rows set aside for evaluation (data.val_fraction, RL) or for the
validation loss (sft.val_fraction), and the rest, which is trained on.

One function for both, so both mean the same by "a fraction held out": at least one row when the fraction is above
0, never every row, and the choice a pure function of (the row count, the fraction, the seed, the salt). Every
process that reads the same files with the same settings therefore holds out the same rows, with nothing to
exchange: the learner's dealer (buffer/dealing.py), a generator walking its own copy (generator/main.py) and the
evaluation rounds all agree on which rows are which.
"""
import random


class SplitError(ValueError):
    """The fraction would leave nothing to train on, or is not a fraction."""


def held_out_indexes(count: int, fraction: float, seed: int, salt: str) -> set:
    """The indexes (of `count` rows) held out: round(fraction × count) of them, at least one when fraction > 0,
    chosen by a shuffle seeded with `salt:seed` (the salt keeps two splits of one seed apart)."""
    if not 0 <= fraction < 1:
        raise SplitError(f"the held-out fraction must be in [0, 1), got {fraction}")
    if fraction == 0 or count == 0:
        return set()
    held = max(1, int(round(fraction * count)))
    if held >= count:
        raise SplitError(f"a held-out fraction of {fraction} leaves nothing to train on out of {count} rows")
    order = list(range(count))
    random.Random(f"{salt}:{seed}").shuffle(order)
    return set(order[:held])


def split_held_out(items: list, fraction: float, seed: int, salt: str) -> tuple[list, list]:
    """(kept, held out): `items` in their order, the `held_out_indexes` ones apart."""
    chosen = held_out_indexes(len(items), fraction, seed, salt)
    return ([item for i, item in enumerate(items) if i not in chosen],
            [item for i, item in enumerate(items) if i in chosen])
