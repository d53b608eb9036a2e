"""sort_letters' reward: partial credit, the share of positions holding the right letter, over the longer of the
answer and the truth (so padding or truncating the answer costs); 1.0 only for exactly the sorted letters."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not isinstance(solution_str, str):
        return 0.0
    answer = solution_str.strip()
    right = sum(a == b for a, b in zip(answer, ground_truth))
    return right / max(len(answer), len(ground_truth), 1)
