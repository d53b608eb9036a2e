"""The suite of bench/time_to_reward.py: each task's name and the function that builds it (through the public
path, cached under a root folder) and returns its SuiteTask."""
from asyncrl.bench.suite import digit_words, sort_letters, spell_backward
from asyncrl.bench.suite.task import SuiteTask, demo_task, tools_task

SUITE = {"sort": demo_task, "tools": tools_task, "digit_words": digit_words.build,
         "sort_letters": sort_letters.build, "spell_backward": spell_backward.build}
"""Task name -> builder(root, seed) -> SuiteTask, in the order the suite runs them. The demo (sort) and the tool
demo were the tasks asyncrl's defaults were chosen on; the other three never were (docs/benchmarks.md "The task
suite")."""


def build_task(name: str, root: str, seed: int = 0) -> SuiteTask:
    if name not in SUITE:
        raise ValueError(f"no suite task {name!r}: the suite has {', '.join(SUITE)}")
    return SUITE[name](root, seed)
