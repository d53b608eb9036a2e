"""Competition math (MATH, MATH-500, AIME, DAPO-Math, NuminaMath; verl's data_source names in functions.py):
the completion's final answer checked against the ground truth with Hugging Face's `math-verify`.

math-verify parses both sides to SymPy (boxed answers first, then LaTeX, then plain expressions) and compares them
symbolically, so "\\frac{1}{2}", "0.5" and "1/2" agree, where verl's default string match would not. A ground
truth without a box is boxed first, so a bare "3" is read as the answer and not as any number in a sentence.
1.0 for an equivalent answer, 0.0 otherwise, including when nothing parses (`answer_found` says which).

math-verify bounds its parsing with SIGALRM, which only the main thread may set; asyncrl's reward workers call
this in their main thread, and elsewhere (a thread) the bound is off and the worker's own timeout applies.
"""
import threading


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    truth = str(ground_truth).strip()
    gold = parse(truth if "\\boxed" in truth else f"\\boxed{{{truth}}}", parsing_timeout=timeout)
    answer = parse(str(solution_str), parsing_timeout=timeout)
    if not gold or not answer:
        return {"score": 0.0, "answer_found": float(bool(answer))}
    return {"score": float(verify(gold, answer, timeout_seconds=timeout)), "answer_found": 1.0}
