"""Scoring of reasoning-gym rows (data.source=reasoning_gym; the rows are built by data/reasoning_gym.py) by the
package's own verifiers, so such a job needs no scorer of ours.

Each row carries its reasoning-gym entry in `extra_info["entry"]`: the verifier needs the entry's metadata, not
only the answer. The completion's answer is the content of its last <answer>...</answer>, or, without one, its last
non-empty line.
"""
import re

from asyncrl.data.reasoning_gym import PREFIX, import_reasoning_gym

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def final_answer(text: str) -> str | None:
    tagged = ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    entry = (extra_info or {}).get("entry") if isinstance(extra_info, dict) else None
    if not isinstance(entry, dict):
        raise ValueError(f"{data_source}: the row carries no reasoning-gym entry in extra_info['entry']")
    verify = import_reasoning_gym().get_score_answer_fn(data_source[len(PREFIX):])
    answer = final_answer(str(solution_str))
    return {"score": float(verify(answer, entry)), "answer_found": float(answer is not None)}
