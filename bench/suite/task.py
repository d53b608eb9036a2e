"""A task of bench/time_to_reward.py's suite: what a run needs to train on it and what the judge scores it on.

The suite measures asyncrl's defaults on tasks nobody tuned them for. Every task is reached through the public path
only (a recipe, overrides, files on disk), so asyncrl, asyncrl at η = 0 and TRL read exactly the same inputs.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class SuiteTask:
    name: str
    recipe: str
    """`asyncrl run --config` value (a shipped recipe's name or a path); TRL's runner loads the same."""
    overrides: tuple
    """Dotlist overrides for every run of the task, asyncrl and TRL alike (model.path, data.train_files,
    reward.path, ...)."""
    test_files: tuple
    """The held-out split the judge scores every run's final model on (none of it trained on)."""
    target: float
    """The sampled reward both frameworks are timed to (a level the default reaches well inside the budget)."""
    steps: int
    """RL steps of one run in the suite."""


def demo_task(root: str, seed: int = 0) -> SuiteTask:
    """The CPU demo as shipped (digit sort, configs/demo_cpu.yaml): its assets are cached by the demo itself."""
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import heldout_file

    cfg = load_config("demo_cpu.yaml", [])
    return SuiteTask(name="sort", recipe="demo_cpu.yaml", overrides=(), test_files=(heldout_file(cfg.demo, seed),),
                     target=0.6, steps=500)
