"""The one error of the reward path, in a module of its own so that every part of it (the functions, the scorer,
the reward server's client) can raise it without importing the others."""


class RewardError(RuntimeError):
    """The reward function is missing, failed, or returned something that is not a finite score.

    `RewardScorer` counts a call that raised it as `bad_value` (the function answered, but not with a score), any
    other exception as `error`; it matches by the type's name, which is all that crosses a worker's pipe."""
