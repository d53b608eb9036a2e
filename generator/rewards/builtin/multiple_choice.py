"""Multiple choice (data_source "multiple_choice", and MMLU, ARC, GPQA, CommonsenseQA by their hub names in
functions.py): the letter the completion commits to, against the ground truth's letter.

The committed letter is the last of: "answer is (X)" / "Answer: X", a boxed letter, or a lone "(X)" or "X." at
the end. Scanning for the last standalone capital would reward a completion that lists every option, so nothing
else counts: no committed letter scores 0.0 (`answer_found` 0). The ground truth is a letter ("C"), "(C)", or an
option index (2 -> "C"); `extra_info["choices"]`, when given, bounds the letters that exist.
"""
import re

COMMITTED = (
    re.compile(r"answer\s*(?:is|:)\s*:?\s*\(?\s*([A-Z])\s*\)?(?![A-Za-z])", re.IGNORECASE),
    re.compile(r"\\boxed\{\s*\(?([A-Z])\)?\s*\}"),
    re.compile(r"(?:^|\s)\(([A-Z])\)\s*\.?\s*$"),
    re.compile(r"(?:^|\s)([A-Z])[.)]\s*$"),
)


def committed_letter(text: str) -> str | None:
    """The letter `text` commits to (see the module docstring), or None."""
    best = None
    for pattern in COMMITTED:
        for match in pattern.finditer(text):
            if best is None or match.start() >= best[0]:
                best = (match.start(), match.group(1).upper())
    return best[1] if best else None


def truth_letter(ground_truth) -> str | None:
    if isinstance(ground_truth, int) or (isinstance(ground_truth, str) and ground_truth.strip().isdigit()):
        index = int(ground_truth)
        return chr(ord("A") + index) if 0 <= index < 26 else None
    text = str(ground_truth).strip().strip("()").strip()
    return text.upper() if len(text) == 1 and text.isalpha() else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    expected = truth_letter(ground_truth)
    if expected is None:
        raise ValueError(f"multiple-choice ground truth must be a letter or an option index, got {ground_truth!r}")
    letter = committed_letter(str(solution_str))
    choices = (extra_info or {}).get("choices") if isinstance(extra_info, dict) else None
    if letter is not None and choices is not None and ord(letter) - ord("A") >= len(choices):
        letter = None  # no such option
    return {"score": float(letter == expected), "answer_found": float(letter is not None)}
