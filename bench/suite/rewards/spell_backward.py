"""spell_backward's reward: reasoning-gym's own verifier (`score_answer` of the spell_backward dataset), given the
task's entry, which the row carries as JSON in extra_info["entry"] (parquet keeps it whole that way). The
verifier gives partial credit (1/len per leading position right) and 1.0 only for the exact reversal."""
import json

_VERIFIER = None


def verifier():
    global _VERIFIER
    if _VERIFIER is None:
        import reasoning_gym

        _VERIFIER = reasoning_gym.get_score_answer_fn("spell_backward")
    return _VERIFIER


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not isinstance(solution_str, str):
        return 0.0
    entry = json.loads(extra_info["entry"]) if extra_info and extra_info.get("entry") else {"answer": ground_truth}
    return float(verifier()(solution_str.strip(), entry))
