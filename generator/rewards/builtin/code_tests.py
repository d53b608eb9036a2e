"""Code (data_source "codecontests", "apps", "codeforces", "taco", verl's names): the completion's last Python
code block run against the ground truth's tests in the sandbox of the built-in `python` tool
(generator/agents/sandbox.py: a confined subprocess, no network where the kernel allows, CPU, memory, process and
wall-clock limits).

The ground truth is the APPS / PRIME format, a dict or its JSON: {"inputs": [...], "outputs": [...]} for stdin to
stdout programs, plus "fn_name" for call-based ones (inputs are argument lists, outputs return values). The score
is the fraction of tests passed (verl's `continuous=True`), with `all_passed` beside it.

Reward hacking is the threat here, not crashes: the program is the policy's, and it is rewarded for what this
module concludes. So only the inputs go into the sandbox; the program's outputs come back and are compared here,
where the program cannot reach the expected outputs or the verdict. stdout comparisons are by whitespace-separated
tokens, as APPS's checker does. Each test has its own time bound inside the sandbox (a test that hangs fails
alone), and the whole run the sandbox's.
"""
import asyncio
import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
PER_TEST_S = 2.0
MAX_TESTS = 64
"""Tests run per completion at most (the first ones): a dataset row with hundreds would make scoring dominate."""

HARNESS = '''
import contextlib, io, json, signal, sys
SOLUTION, INPUTS, FN, NONCE, PER_TEST_S = {solution!r}, json.loads({inputs!r}), {fn!r}, {nonce!r}, {per_test_s!r}
out = sys.stdout
class Late(Exception):
    pass
def late(*_):
    raise Late()
signal.signal(signal.SIGALRM, late)
for k, given in enumerate(INPUTS):
    record, buffer = {{"k": k, "ok": False}}, io.StringIO()
    try:
        signal.setitimer(signal.ITIMER_REAL, PER_TEST_S)
        scope = {{"__name__": "__main__" if FN is None else "solution"}}
        sys.stdin = io.StringIO(given if isinstance(given, str) else "\\n".join(map(str, given)))
        with contextlib.redirect_stdout(buffer):
            try:
                exec(compile(SOLUTION, "<solution>", "exec"), scope)
                if FN is not None:
                    fn = scope.get(FN) or getattr(scope["Solution"](), FN)
                    record["value"] = fn(*given)
            except SystemExit as stop:
                if stop.code not in (None, 0):
                    raise
        record["ok"], record["stdout"] = True, buffer.getvalue()
        if FN is not None:
            json.dumps(record["value"])
    except BaseException as err:
        record = {{"k": k, "ok": False, "error": type(err).__name__}}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    out.write(NONCE + " " + json.dumps(record, default=str) + "\\n")
    out.flush()
'''


def last_code_block(text: str) -> str | None:
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def parse_tests(ground_truth) -> tuple[list, list, str | None]:
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) or \
            not isinstance(tests.get("outputs"), list) or len(tests["inputs"]) != len(tests["outputs"]):
        raise ValueError("code ground truth must be {'inputs': [...], 'outputs': [...]} of equal lengths "
                         "(and 'fn_name' for call-based tests)")
    return tests["inputs"][:MAX_TESTS], tests["outputs"][:MAX_TESTS], tests.get("fn_name") or None


def passed(record: dict, expected, fn_name) -> bool:
    if not record.get("ok"):
        return False
    if fn_name is not None:
        value = record.get("value")
        return value == expected or (isinstance(expected, list) and len(expected) == 1 and value == expected[0])
    return record.get("stdout", "").split() == str(expected).split()


def run_harness(harness: str, timeout_s: float) -> str:
    """The sandbox's stdout (async in the tool; run on a loop of its own thread, wherever this is called)."""
    from asyncrl.generator.agents.sandbox import run_python
    from asyncrl.generator.config import SandboxConfig

    limits = SandboxConfig(timeout_s=timeout_s, cpu_s=int(timeout_s) + 1, max_output_bytes=8 << 20)
    with ThreadPoolExecutor(max_workers=1) as pool:
        result = pool.submit(asyncio.run, run_python(harness, limits)).result()
    return result.stdout if result.error is None else ""


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    inputs, outputs, fn_name = parse_tests(ground_truth)
    code = last_code_block(str(solution_str))
    if code is None or not inputs:
        return {"score": 0.0, "all_passed": 0.0, "answer_found": float(code is not None)}
    nonce = secrets.token_hex(16)
    harness = HARNESS.format(solution=code, inputs=json.dumps(inputs), fn=fn_name, nonce=nonce,
                             per_test_s=PER_TEST_S)
    records = {}
    for line in run_harness(harness, PER_TEST_S * len(inputs) + 5.0).splitlines():
        if line.startswith(nonce + " "):
            try:
                record = json.loads(line[len(nonce) + 1:])
                # first line per test; a program that forged one only claimed an output, which is checked here
                records.setdefault(int(record["k"]), record)
            except (ValueError, KeyError, TypeError):
                continue
    good = sum(passed(records.get(k, {}), expected, fn_name) for k, expected in enumerate(outputs))
    return {"score": good / len(outputs), "all_passed": float(good == len(outputs)), "answer_found": 1.0}
