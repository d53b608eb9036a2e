"""Demo task: sort a string of 4-7 digits (`sort:5021=` -> `0125`). Exact, verifiable, learnable on 2 CPU cores.

Rows follow verl's format so the same code reads a user's dataset: `prompt` (chat messages), `data_source`,
`reward_model.ground_truth`, `extra_info`.
"""
import random

DATA_SOURCE = "asyncrl/sort_digits"
ALPHABET = "0123456789sort:="


def make_rows(num_prompts: int, seed: int, min_len: int = 4, max_len: int = 7) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"sort:{digits}="}],
                "data_source": DATA_SOURCE,
                "reward_model": {"style": "rule", "ground_truth": "".join(sorted(digits))},
                "extra_info": {"index": index, "split": "train"},
            }
        )
    return rows


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> dict:
    """1.0 for an exact match, else 0.0; `char_acc` (fraction of right characters) is reported alongside."""
    solution = solution_str.strip()
    matches = sum(a == b for a, b in zip(solution, ground_truth))
    return {
        "score": float(solution == ground_truth),
        "char_acc": matches / max(len(ground_truth), len(solution), 1),
    }
