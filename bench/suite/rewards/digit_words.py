"""digit_words' reward: 1.0 for exactly the digits spelled out as words ("407" -> "four zero seven"), else 0.0.
All or nothing on a 11-29 character answer: the suite's long-answer task."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not isinstance(solution_str, str):
        return 0.0
    return 1.0 if " ".join(solution_str.split()) == ground_truth else 0.0
