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
    warm_start: str = ""
    """The model directory every run starts from (the task's `asyncrl sft` output); empty: the recipe's demo builds
    it (demo_cpu.yaml, tools_cpu.yaml)."""


def demo_task(root: str, seed: int = 0) -> SuiteTask:
    """The CPU demo as shipped (digit sort, configs/demo_cpu.yaml): its assets are cached by the demo itself."""
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import heldout_file

    cfg = load_config("demo_cpu.yaml", [])
    return SuiteTask(name="sort", recipe="demo_cpu.yaml", overrides=(), test_files=(heldout_file(cfg.demo, seed),),
                     target=0.6, steps=500)


def tools_task(root: str, seed: int = 0) -> SuiteTask:
    """The CPU tool demo as shipped (4-digit addition with the calculator tool, configs/tools_cpu.yaml): its assets
    are cached by the demo itself; the target is below the 0.64 it reached in 120 steps (docs/benchmarks.md "The
    tool demo")."""
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import heldout_file

    cfg = load_config("tools_cpu.yaml", [])
    return SuiteTask(name="tools", recipe="tools_cpu.yaml", overrides=(), test_files=(heldout_file(cfg.demo, seed),),
                     target=0.5, steps=120)


def multi_turn_tools(cfg) -> list | None:
    """A config's tools when its episodes are multi-turn ([] for rollout.max_turns > 1 without tools), None when each
    episode is one model turn: the judge (`asyncrl eval` scores one turn) and TRL's runner both refuse the former."""
    tools = list(cfg.tools.builtins or cfg.tools.functions or cfg.tools.mcp_servers)
    return tools if tools or cfg.rollout.max_turns > 1 else None
