"""What a reward server scores: one item per sample, checked at the door (the server is called by generators it
does not control, and each item is held in memory until it is scored)."""
import math
from dataclasses import dataclass

MAX_TEXT_CHARS = 1 << 20
"""Longest prompt or response text one item may carry."""


class BadItem(ValueError):
    """An item that is not a reward request (HTTP 400)."""


@dataclass
class ScoreItem:
    prompt: list
    """The row's prompt as chat messages ([{role, content}])."""
    response: str
    data_source: str = ""
    ground_truth: object = None


def parse_items(body, max_items: int) -> list:
    """{"items": [{"prompt": str | messages, "response": str, "data_source"?, "ground_truth"?}, ...]}."""
    items = body.get("items") if isinstance(body, dict) else None
    if not isinstance(items, list) or not items:
        raise BadItem("the body must be {\"items\": [{\"prompt\": ..., \"response\": ...}, ...]}")
    if len(items) > max_items:
        raise BadItem(f"{len(items)} items in one request; at most {max_items} (reward_server.max_queue)")
    return [parse_item(item, index) for index, item in enumerate(items)]


def parse_item(item, index: int) -> ScoreItem:
    if not isinstance(item, dict):
        raise BadItem(f"items[{index}] is not an object")
    prompt, response = item.get("prompt"), item.get("response")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not (isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in prompt)):
        raise BadItem(f"items[{index}].prompt must be a string or a list of {{role, content}} messages")
    if not isinstance(response, str):
        raise BadItem(f"items[{index}].response must be a string")
    if len(response) + sum(len(m["content"]) for m in prompt) > MAX_TEXT_CHARS:
        raise BadItem(f"items[{index}] is longer than {MAX_TEXT_CHARS} characters")
    data_source = item.get("data_source", "")
    return ScoreItem([{"role": m["role"], "content": m["content"]} for m in prompt], response,
                     data_source if isinstance(data_source, str) else "", item.get("ground_truth"))


def check_score(value) -> float:
    """A score the server may send back: a finite float."""
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"the reward model produced a non-finite score ({score})")
    return score
