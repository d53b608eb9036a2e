"""The learner's learning-rate schedule (`learner.lr_schedule`): a linear warmup, then constant, linear or cosine
decay to `learner.min_lr_ratio` of the peak at `learner.total_steps`.

A pure function of the optimizer step, so it is tested against hand-computed values and a resumed learner (whose
LambdaLR restores its step count) lands on the same rate.
"""
import math

SCHEDULES = ("constant", "linear", "cosine")


def resync_after_load(scheduler) -> None:
    """After a checkpoint's scheduler and optimizer state are loaded: set each group's rate from THIS job's
    schedule at the restored step. The loaded state carries the rate the previous life computed, from its own
    schedule, so a job resumed with more steps (a decay stretched over them) would otherwise take its first step
    at the old schedule's rate."""
    for group, multiplier in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = group["initial_lr"] * multiplier(scheduler.last_epoch)


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str = "constant",
                  min_ratio: float = 0.0) -> float:
    """The fraction of the peak rate for optimizer step `step` (0-based: LambdaLR's count). Warmup rises linearly
    to 1 at step `warmup_steps`; decay then runs over the remaining total_steps - warmup_steps steps and stays at
    `min_ratio` past them."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {SCHEDULES}")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay
