"""The environment interface every multi-turn episode runs against, and loading a user's environment class.

An environment is a class with two coroutines, built once per episode with no arguments:

    async def reset(self, row: dict) -> list | None
        The episode's opening messages (chat messages, e.g. a system prompt and the task), or None to open with
        the row's own prompt. `row` has prompt_id, prompt (messages), data_source, ground_truth, extra_info.
    async def step(self, text: str) -> StepResult
        `text` is the model's turn, decoded (for reading only: the tokens stay as sampled). The result's
        `messages` are appended as the next environment turn (rendered by the chat template, loss_mask 0).

A step with `done=True` ends the episode. Rewards: when any step returned a reward, the episode's reward is their
sum; when none did, the job's reward function scores the last model turn, as in single-turn sampling. Each reset
and step runs under `env.step_timeout_s`; one that raises or times out ends the episode (`env_error`), scored 0,
and counted in `rollout/env_errors/<reason>`. The tool environment (tool_env.py) is one such class.
"""
import inspect
from dataclasses import dataclass, field
from typing import Optional

from asyncrl.generator.user_code.loader import load_from_file


@dataclass
class StepResult:
    messages: list = field(default_factory=list)
    """Messages appended for the model to read next (roles the chat template knows: tool, user, system)."""
    reward: Optional[float] = None
    """This step's reward; None: this step gives none."""
    done: bool = False
    """The episode is over; no model turn follows."""
    info: dict = field(default_factory=dict)
    """Named numbers to log with the sample's reward_info."""
    tool_calls: int = 0
    """Tool calls this step answered (refused ones included), for rollout/tool_calls/mean."""


class EnvironmentLoadError(ValueError):
    """The environment class is missing or does not have the interface (the message says what is wrong)."""


def load_environment_class(path: str, name: str):
    """The class `name` in the Python file `path`, checked for async `reset` and `step`."""
    try:
        cls = load_from_file(path, name, "env.path")
    except FileNotFoundError as err:
        raise EnvironmentLoadError(str(err)) from None
    if not inspect.isclass(cls):
        raise EnvironmentLoadError(f"env.name {name!r} is not a class in {path}")
    check_environment_class(cls)
    return cls


def check_environment_class(cls) -> None:
    for method in ("reset", "step"):
        fn = getattr(cls, method, None)
        if not inspect.iscoroutinefunction(fn):
            raise EnvironmentLoadError(f"{cls.__name__}.{method} must be an `async def` (the generator awaits it, "
                                    f"so a step that waits on I/O never blocks sampling)")


def messages_problem(messages) -> str | None:
    """None if `messages` is a list of chat messages (a dict with a string role and a string content each),
    else what is wrong: a template renders a malformed message as garbage rather than failing."""
    if not isinstance(messages, list):
        return f"messages must be a list, got {type(messages).__name__}"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} is a {type(message).__name__}, not a dict"
        if not isinstance(message.get("role"), str) or not message["role"]:
            return f"message {index} has no role"
        if not isinstance(message.get("content"), str):
            return f"message {index} ({message['role']}) has no text content"
    return None
