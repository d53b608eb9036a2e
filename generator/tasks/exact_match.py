"""The demo tasks' reward: exact match of the answer against the ground truth, with the fraction of right
characters beside it (a signal to watch while the exact reward is still mostly 0)."""


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> dict:
    """1.0 when the stripped answer equals the ground truth, else 0.0; `char_acc` alongside."""
    solution = solution_str.strip()
    matches = sum(a == b for a, b in zip(solution, ground_truth))
    return {
        "score": float(solution == ground_truth),
        "char_acc": matches / max(len(ground_truth), len(solution), 1),
    }
