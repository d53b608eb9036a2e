"""GSM8K (data_source "openai/gsm8k", verl's name): the answer is the number after the last "####".

As verl's scorer: 1.0 for the right number, 0.0 otherwise, and a completion without a "#### <number>" line scores
0.0 too (`answer_found` says which). Numbers compare as numbers ("1,000", "1000.0" and "$1000" are 1000), because
formatting is not what GSM8K tests. The ground truth may be the bare number (verl's preprocessed parquet) or the
dataset's whole solution text ending in "#### n".
"""
import re
from decimal import Decimal, InvalidOperation

ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
TAIL_CHARS = 300
"""Only the end of a completion is searched (verl clips the same way): the answer line is last, and a regex over
a 10k-token ramble would cost more than the rest of the scoring."""


def extract(text: str) -> str | None:
    """The number after the last "####" in `text`, without thousands separators, or None."""
    found = ANSWER.findall(text[-TAIL_CHARS:])
    return found[-1].replace(",", "") if found else None


def as_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip())
    except (InvalidOperation, AttributeError):
        return None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    answer = extract(str(solution_str))
    truth = extract(str(ground_truth)) if "####" in str(ground_truth) else str(ground_truth)
    expected = as_number(truth)
    got = as_number(answer) if answer is not None else None
    right = got is not None and expected is not None and got == expected
    return {"score": float(right), "answer_found": float(answer is not None)}
