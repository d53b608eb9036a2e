"""digit_words, the suite's long-answer task: spell a 3-5 digit string out as words, `say:407=` -> `four zero
seven` (answers of 11-29 characters, most 12-24; the demo's are 4-7), scored all or nothing.

Few decisions per answer (one word per digit) but many tokens: generation takes a larger share of each step than on
the demo, the shape where overlapping generation with training should pay most.
"""
import os
import random

from asyncrl.bench.suite.assets import BuildSettings, build_assets, draw_unique, verl_row
from asyncrl.bench.suite.task import SuiteTask

NAME = "digit_words"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
REWARD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rewards", "digit_words.py")


def spell(digits: str) -> str:
    return " ".join(WORDS[int(digit)] for digit in digits)


def make_splits(num_train: int, num_sft: int, num_test: int, seed: int) -> dict:
    rng, taken = random.Random(seed), set()

    def draw() -> str:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 5)))

    sizes = {"test": num_test, "train": num_train, "sft": num_sft}  # test first: held out of the others
    return {split: [verl_row(NAME, f"say:{digits}=", spell(digits), split, i)
                    for i, digits in enumerate(draw_unique(size, draw, taken))] for split, size in sizes.items()}


def build(root: str, seed: int = 0, num_train: int = 4096, num_sft: int = 2048, num_test: int = 128,
          sft_steps: int = 100, sft_batch_size: int = 64, hidden: int = 128, layers: int = 4) -> SuiteTask:
    settings = BuildSettings(name=NAME, seed=seed, num_train=num_train, num_sft=num_sft, num_test=num_test,
                             hidden=hidden, layers=layers, sft_steps=sft_steps, sft_batch_size=sft_batch_size,
                             recipe={"rollout": {"max_tokens": 36}})
    paths = build_assets(root, settings, lambda: make_splits(num_train, num_sft, num_test, seed), REWARD_FILE)
    return SuiteTask(name=NAME, recipe=paths.recipe, overrides=(), test_files=(paths.test,), target=0.6,
                     steps=300, warm_start=paths.model)
