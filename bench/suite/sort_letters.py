"""sort_letters, the suite's partial-reward task: sort 5-9 lowercase letters, `sort:qbxaz=` -> `abqxz`, rewarded
with the share of positions right (1.0 only when exact), so GRPO sees graded rewards rather than 0/1.
"""
import os
import random
import string

from asyncrl.bench.suite.assets import BuildSettings, build_assets, draw_unique, verl_row
from asyncrl.bench.suite.task import SuiteTask

NAME = "sort_letters"
REWARD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rewards", "sort_letters.py")


def make_splits(num_train: int, num_sft: int, num_test: int, seed: int) -> dict:
    rng, taken = random.Random(seed), set()

    def draw() -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(5, 9)))

    sizes = {"test": num_test, "train": num_train, "sft": num_sft}  # test first: held out of the others
    return {split: [verl_row(NAME, f"sort:{letters}=", "".join(sorted(letters)), split, i)
                    for i, letters in enumerate(draw_unique(size, draw, taken))] for split, size in sizes.items()}


def build(root: str, seed: int = 0, num_train: int = 4096, num_sft: int = 2048, num_test: int = 128,
          sft_steps: int = 65, sft_batch_size: int = 128, hidden: int = 128, layers: int = 4) -> SuiteTask:
    settings = BuildSettings(name=NAME, seed=seed, num_train=num_train, num_sft=num_sft, num_test=num_test,
                             hidden=hidden, layers=layers, sft_steps=sft_steps, sft_batch_size=sft_batch_size,
                             recipe={"rollout": {"max_tokens": 12}})
    paths = build_assets(root, settings, lambda: make_splits(num_train, num_sft, num_test, seed), REWARD_FILE)
    return SuiteTask(name=NAME, recipe=paths.recipe, overrides=(), test_files=(paths.test,), target=0.6,
                     steps=300, warm_start=paths.model)
