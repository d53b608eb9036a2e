"""The suite of bench/time_to_reward.py: each task's name and the function that builds it (through the public
path, cached under a root folder) and returns its SuiteTask."""
from asyncrl.bench.suite.task import SuiteTask, demo_task

SUITE = {"sort": demo_task}
"""Task name -> builder(root, seed) -> SuiteTask, in the order the suite runs them."""


def build_task(name: str, root: str, seed: int = 0) -> SuiteTask:
    if name not in SUITE:
        raise ValueError(f"no suite task {name!r}: the suite has {', '.join(SUITE)}")
    return SUITE[name](root, seed)
