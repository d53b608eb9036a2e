"""Kill -9 the learner mid-run, start it again, and it carries on bit-identically from its last checkpoint.

The learner is the real `asyncrl learner` process (one rank, and two ranks of FSDP2 × Ulysses under torchrun). The
generator is a scripted client of the real ZeroMQ protocol: the groups it sends depend only on the version they
are admitted at and their index within it, so an uninterrupted run and a killed-and-resumed run train on the
same data and their loss curves can be compared exactly.
"""
import json
import os
import signal
import threading
import time

import pytest

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.zmq.wire import pack, unpack_reply
from tests.conftest import free_port
from tests.e2e.jobs import (GROUPS_PER_STEP, N, QUIET_TELEMETRY, SAMPLING, child_pids, run_to_end, scripted_group,
                            start_learner, wait_until_gone)


class ScriptedGenerator(threading.Thread):
    """Says hello, asks for admission, sends scripted groups; reconnects when the learner goes away."""

    def __init__(self, port: int, config_hash: str, hold_from: int | None = None):
        super().__init__(daemon=True)
        self.port, self.config_hash, self.hold_from = port, config_hash, hold_from
        self.stop = threading.Event()
        self.release = threading.Event()  # groups for versions >= hold_from wait for it
        self.incarnations = 0
        self.errors = []

    def run(self):
        import zmq

        context = zmq.Context()
        try:
            while not self.stop.is_set():
                sock = context.socket(zmq.DEALER)
                sock.connect(f"tcp://127.0.0.1:{self.port}")
                try:
                    self.session(sock)
                except TimeoutError:
                    pass  # the learner is gone (killed): connect again and wait for the next one
                finally:
                    sock.close(linger=0)
        except Exception as err:  # surfaced by the test
            self.errors.append(repr(err))
        finally:
            context.term()

    def session(self, sock):
        req = 0

        def ask(op, body=None, timeout_s=3.0, **fields):
            nonlocal req
            req += 1
            frames = [pack({"op": op, "req": req, "gen": "scripted", **fields})] + ([body] if body else [])
            sock.send_multipart(frames)
            while sock.poll(int(timeout_s * 1000)):
                reply = unpack_reply(sock.recv_multipart()[0])
                if reply["req"] == req:
                    return reply
            raise TimeoutError(op)

        hello = ask("hello", config_hash=self.config_hash)
        assert hello["ok"], hello
        self.incarnations += 1
        sent = {}  # version -> groups sent this session
        while not self.stop.is_set():
            reply = ask("admit", want=1)
            if reply["done"]:
                self.stop.set()
                return
            if not reply.get("granted"):
                time.sleep(0.02)
                continue
            version = reply["version"]
            if self.hold_from is not None and version >= self.hold_from and not self.release.is_set():
                self.release.wait()  # the learner waits for this batch meanwhile (the test kills it there)
                raise TimeoutError("released: start over with whichever learner is up now")
            index = sent.get(version, 0)
            sent[version] = index + 1
            answer = ask("group", body=encode_group(scripted_group(version, index, self.incarnations)))
            assert answer.get("accepted"), answer


def learner_overrides(model_dir, port, steps):
    return [f"model.path={model_dir}", "demo.task=''", "algo.dynamic_sampling=false",
            f"buffer.port={port}", f"learner.total_steps={steps}",
            "buffer.max_staleness=0", f"buffer.groups_per_step={GROUPS_PER_STEP}", f"rollout.n={N}",
            f"rollout.max_tokens={SAMPLING.max_tokens}", "learner.checkpoint_every=2", "learner.checkpoint_keep=2",
            "learner.torch_threads=1", "learner.lr=1e-3", "learner.warmup_steps=0", "buffer.done_grace_s=1",
            "telemetry.progress=false", *QUIET_TELEMETRY,
            # the scripted generator's logprobs are made up (tests/e2e/jobs.py): learner/trust.py would quarantine it
            "learner.quarantine_abs_diff=0",
            # a reward-KL coefficient the adaptive controller moves every step: the resumed run continues the same
            # loss curve only if the checkpoint kept it (LearnerState.kl_coef)
            "algo.kl_reward_coef=0.05", "algo.kl_controller=adaptive", "algo.kl_target=0.001", "algo.kl_horizon=40"]


def losses(job_dir):
    """step -> (loss/pg, the reward-KL coefficient the step used)."""
    with open(os.path.join(job_dir, "progress.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return {row["step"]: (row["loss/pg"], row["kl/reward_coef"]) for row in rows}


def wait_for_checkpoint(path, proc, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while not os.path.isfile(os.path.join(path, "meta.json")):
        assert proc.poll() is None, "the learner exited before its checkpoint"
        assert time.monotonic() < deadline, f"no checkpoint at {path}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,sp,background", [(1, 1, True), (2, 2, False)])
def test_kill_9_then_resume_continues_the_loss_curve_bit_identically(tiny_model_dir, tmp_path, nproc, sp, background):
    """One rank saving in the background (DCP async_save), and two ranks of FSDP2 × Ulysses saving in line."""
    from asyncrl.configs import load_config, shared_hash

    steps = 6
    results = {}
    for name in ("reference", "killed"):
        job_dir = tmp_path / name
        job_dir.mkdir()
        port = free_port()
        overrides = learner_overrides(tiny_model_dir, port, steps) + [f"learner.sp_size={sp}",
                                                                      f"learner.checkpoint_async={background}"]
        generator = ScriptedGenerator(port, shared_hash(load_config(None, overrides)),
                                      hold_from=4 if name == "killed" else None)
        generator.start()
        proc, log = start_learner(overrides, job_dir, tmp_path, nproc)
        if name == "killed":  # kill -9 once step 4's checkpoint is on disk, while the learner waits for batch 5
            wait_for_checkpoint(job_dir / "checkpoints" / "step-00000004", proc)
            ranks = child_pids(proc.pid)  # torchrun's ranks (each in its own session)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_until_gone(ranks)  # they die with their launcher (PR_SET_PDEATHSIG), freeing the buffer's port
            log.close()
            before = losses(job_dir)
            generator.release.set()
            proc, log = start_learner(overrides, job_dir, tmp_path, nproc, extra=["--resume"])
        run_to_end(proc, log)
        generator.stop.set()
        generator.join(timeout=30)
        assert not generator.errors, generator.errors
        results[name] = losses(job_dir)
        summary = json.load(open(job_dir / "summary.json"))
        results[name + "_start"] = summary["start_version"]
        if name == "killed":  # the second life logged into the first life's MLflow run, which its checkpoint named
            from asyncrl.learner.checkpoint import read_state

            first_run = read_state(str(job_dir / "checkpoints" / "step-00000004")).mlflow_run_id
            assert first_run and summary["mlflow_run_id"] == first_run
    reference, killed = results["reference"], results["killed"]
    assert sorted(reference) == list(range(1, steps + 1))
    assert results["killed_start"] == 4 and results["reference_start"] == 0  # the version carries on
    assert all(before[step] == reference[step] for step in before)  # the first life trained the same
    assert reference[6][1] != reference[1][1]  # the controller moved the coefficient
    for step in (5, 6):
        assert killed[step] == reference[step], (step, killed[step], reference[step])  # bit-identical
