"""The built-in `python` tool's sandbox with hostile code: an infinite loop, a fork bomb, a 4 GB allocation,
100 MB of output, a sleep past the timeout. Each ends with a clear message to the model and leaves nothing
running; plus the ordinary case, the scrubbed environment, the removed working directory, and no network."""
import asyncio
import os
import time

import pytest

from asyncrl.generator.agents.sandbox import processes_bounded, python_tool, run_python
from asyncrl.generator.config import SandboxConfig

LIMITS = SandboxConfig(timeout_s=4.0, cpu_s=2, memory_mb=256, max_processes=8, max_output_bytes=10000)


def run(code, limits=LIMITS):
    started = time.monotonic()
    result = asyncio.run(run_python(code, limits))
    return result, time.monotonic() - started


def descendants() -> set:
    """Processes whose parent is this test process (a sandbox that leaks leaves some)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == os.getpid() and fields[0] != "Z":
                    found.add(int(entry))
            except (OSError, IndexError):
                continue
    return found


def test_ordinary_code_prints_its_answer_in_a_clean_temporary_directory():
    result, _ = run("import os, sys\nprint(1234 + 5678)\nprint(os.getcwd())\nprint(sorted(os.environ))\n"
                    "open('scratch.txt', 'w').write('x')")
    lines = result.text().splitlines()
    assert result.exit_code == 0 and lines[0] == "6912"
    assert "asyncrl-sandbox-" in lines[1] and not os.path.exists(lines[1])  # removed after the call
    assert "PYTHONPATH" not in lines[2] and "HOME" in lines[2] and "MLFLOW_TRACKING_URI" not in lines[2]
    failed, _ = run("raise ValueError('bad input')")
    assert "error (exit code 1)" in failed.text() and "ValueError: bad input" in failed.text()


def test_an_infinite_loop_is_stopped_by_its_cpu_limit():
    result, elapsed = run("while True:\n    pass", SandboxConfig(timeout_s=10.0, cpu_s=1))
    assert "used up its CPU time" in result.text() and elapsed < 10.0


def test_a_sleep_past_the_timeout_is_killed_with_what_it_started():
    before = descendants()  # other tests' session fixtures (a vLLM engine core) may be children of this process
    result, elapsed = run("import subprocess, time\nsubprocess.Popen(['sleep', '60'])\ntime.sleep(60)")
    assert "did not finish within its time limit" in result.text()
    assert 3.5 < elapsed < 8.0
    assert descendants() <= before


def test_a_huge_allocation_fails_inside_the_code():
    result, _ = run("x = bytearray(4 * 2**30)\nprint('allocated')")
    assert "MemoryError" in result.text() and "allocated" not in result.text()


def test_100_mb_of_output_is_cut_off():
    result, elapsed = run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)")
    assert "more than the sandbox's output limit" in result.text() and elapsed < 4.0


@pytest.mark.skipif(not processes_bounded(), reason="as root without a writable pids cgroup only the timeout "
                                                    "bounds processes")
def test_a_fork_bomb_is_contained_and_nothing_survives_it():
    before = descendants()
    result, elapsed = run("import os\nwhile True:\n    os.fork()")
    assert result.exit_code != 0 or result.error == "timeout"
    assert ("BlockingIOError" in result.text() or "Resource temporarily unavailable" in result.text()
            or "time limit" in result.text())
    assert elapsed < 8.0
    time.sleep(0.2)
    assert descendants() <= before


def network_namespace_possible() -> bool:
    probe, _ = run("print(1)", SandboxConfig(require_no_network=True))
    return probe.error != "setup"


def test_the_network_is_unreachable_where_a_namespace_can_be_made():
    if not network_namespace_possible():
        probe, _ = run("print(1)", SandboxConfig(require_no_network=True))
        assert "no network namespace could be made" in probe.text()  # refused, as configured
        pytest.skip("this kernel allows no network namespace here; require_no_network refuses, as tested")
    code = ("import socket\ns = socket.socket()\ns.settimeout(1)\n"
            "try:\n    s.connect(('127.0.0.1', 9))\nexcept OSError as err:\n    print(type(err).__name__, err.errno)")
    result, _ = run(code)
    assert result.exit_code == 0
    assert result.text().startswith("OSError 101") or "Network is unreachable" in result.text(), result.text()


def test_the_tool_has_a_schema_and_answers_text():
    from asyncrl.generator.agents.tool_schema import tool_schema

    tool = python_tool(LIMITS)
    schema = tool_schema(tool)
    assert schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["required"] == ["code"]
    assert asyncio.run(tool(code="print(6 * 7)")) == "42\n"


def test_the_model_calls_the_python_tool_through_the_tool_box():
    from asyncrl.generator.agents.tool_calls import ToolCall
    from asyncrl.generator.agents.tools import ToolBox

    box = ToolBox([], workers=1, timeout_s=10.0, max_output_chars=200, builtins=[python_tool(LIMITS)])
    assert box.pool is None and list(box.schemas) == ["python"]

    async def calls():
        return [await box.call(ToolCall("python", {"code": code})) for code in ("print(2**10)", "while True: pass")]

    ok, spun = asyncio.run(calls())
    assert (ok.text, ok.error) == ("1024\n", None)
    assert ("CPU time" in spun.text or "time limit" in spun.text) and spun.error is None  # the sandbox answered
