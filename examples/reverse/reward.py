"""The reversal task's reward, with verl's signature: 1.0 for the exact reversal, else the share of positions
right (partial credit gives GRPO a signal before the first exact answer)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.strip()
    if answer == ground_truth:
        return 1.0
    right = sum(a == b for a, b in zip(answer, ground_truth))
    return 0.5 * right / max(len(ground_truth), len(answer), 1)
