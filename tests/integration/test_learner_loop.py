"""The learner loop in process (learner/loop.py: LearnerState, the rank-0 host, publishing) against a scripted
generator that speaks the real zmq protocol from a thread: with weightsync.every_steps=k the weights are published
every k steps and after the last one, admission stays at the published version, and no group trains staler
than η."""
import asyncio
import json
import threading
import time
import uuid

import numpy as np
import pytest

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.buffer.interface import LearnerUnavailable
from asyncrl.buffer.zmq.client import ZmqBufferClient
from tests.conftest import free_port
from tests.integration.helpers import HONEST_LOGPROB, VOCAB, recipe_sampling


def scripted_group(version: int, rng, sampling: Sampling) -> Group:
    samples = [Sample(completion_ids=rng.integers(2, VOCAB, 4).astype(np.int32), logprobs=np.full(4, HONEST_LOGPROB, np.float32),
                      versions=np.full(4, version, np.int32), reward=float(rng.integers(0, 2)), finish_reason="stop")
               for _ in range(2)]
    return Group(group_id=uuid.uuid4().hex, prompt_id="p", generator_id="scripted",
                 prompt_ids=rng.integers(2, VOCAB, 3).astype(np.int32), samples=samples,
                 sampling=sampling, created_at=time.time())


class ScriptedGenerator(threading.Thread):
    """Samples every admitted group with the newest weights it has heard of, as a real generator does."""

    def __init__(self, endpoint: str, config_hash: str, sampling: Sampling):
        super().__init__(daemon=True)
        self.endpoint, self.config_hash, self.sampling = endpoint, config_hash, sampling
        self.versions_heard: list[int] = []
        self.errors: list[str] = []

    def run(self):
        try:
            asyncio.run(self.generate())
        except Exception as err:  # surfaced by the test
            self.errors.append(repr(err))

    async def generate(self):
        client = ZmqBufferClient(self.endpoint, "scripted", timeout_s=10)
        rng = np.random.default_rng(0)
        try:
            while True:
                try:
                    reply = await client.hello(self.config_hash, timeout_s=1.0)
                    break
                except LearnerUnavailable:
                    continue  # the learner is still starting
            while True:
                self.hear(reply)
                if reply.done:
                    return
                reply = await client.admit(1)
                self.hear(reply)
                if not reply.granted:
                    await asyncio.sleep(0.01)
                    continue
                reply = await client.send(*self.group(rng))
        finally:
            client.close()

    def hear(self, reply) -> None:
        version = reply.weights.version if reply.weights is not None else None
        if version is not None and (not self.versions_heard or version != self.versions_heard[-1]):
            self.versions_heard.append(version)

    def group(self, rng) -> tuple:
        group = scripted_group(self.versions_heard[-1], rng, self.sampling)
        return group.group_id, encode_group(group)


def run_scripted_job(model_dir: str, tmp_path, overrides: list) -> tuple:
    """(the learner's summary, the scripted generator) of one in-process learner on a tiny model fed by a
    ScriptedGenerator; `overrides` go after the shared ones. Run from tmp_path: MLflow writes artifacts under it."""
    from asyncrl.configs import load_config, shared_hash
    from asyncrl.learner.loop import run_learner

    port = free_port()
    cfg = load_config(None, [f"model.path={model_dir}", "demo.task=''", "algo.dynamic_sampling=false",
                             f"buffer.port={port}", "buffer.max_staleness=1", "buffer.groups_per_step=2", "rollout.n=2",
                             "buffer.done_grace_s=5", "telemetry.progress=false", f"weightsync.shm_dir={tmp_path}",
                             f"telemetry.tracking_uri=sqlite:///{tmp_path}/mlflow.db", *overrides])
    generator = ScriptedGenerator(f"tcp://127.0.0.1:{port}", shared_hash(cfg), recipe_sampling(cfg))
    generator.start()
    summary = run_learner(cfg, model_dir, [], str(tmp_path))
    generator.join(timeout=30)
    assert not generator.errors, generator.errors
    return summary, generator


def test_weights_are_published_every_k_steps_and_after_the_last_and_staleness_stays_within_eta(
        tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow writes run artifacts under the working directory
    summary, generator = run_scripted_job(tiny_model_dir, tmp_path,
                                          ["learner.total_steps=5", "weightsync.every_steps=2",
                                           "learner.checkpoint_every=0"])
    assert summary["steps"] == 5
    rows = [json.loads(line) for line in open(tmp_path / "progress.jsonl")]
    assert [row["step"] for row in rows if "timing/weightsync/publish_s" in row] == [2, 4, 5]
    assert generator.versions_heard == [0, 2, 4, 5]  # it sampled with each published version, nothing else
    assert max(row["buffer/staleness/max"] for row in rows) <= 1


def catchup_threads() -> int:
    return sum(thread.name == "asyncrl-weight-catchup" and thread.is_alive() for thread in threading.enumerate())


def test_a_buffer_that_cannot_bind_ends_the_run_failed_and_closes_the_publisher(tiny_model_dir, tmp_path, monkeypatch):
    """The buffer is built after the MLflow run and the weight publisher; when its port is taken the learner
    stops with the bind error, and neither a RUNNING run nor the publisher's catch-up server is left behind."""
    import socket

    from mlflow import MlflowClient

    from asyncrl.configs import load_config
    from asyncrl.learner.loop import run_learner

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "demo.task=''", f"buffer.port={port}",
                                 "buffer.host=127.0.0.1", "telemetry.progress=false", f"weightsync.shm_dir={tmp_path}",
                                 f"telemetry.tracking_uri={uri}", "job.name=bind-fails"])
        threads_before = catchup_threads()
        with pytest.raises(RuntimeError, match=f"buffer cannot bind tcp://127.0.0.1:{port}"):
            run_learner(cfg, tiny_model_dir, [], str(tmp_path))
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.telemetry.experiment).experiment_id])
    assert [(run.info.run_name, run.info.status) for run in runs] == [("bind-fails", "FAILED")]
    assert catchup_threads() == threads_before  # the publisher's catch-up server was closed
    assert not list(tmp_path.glob("*.ring"))


def test_a_prime_job_trains_its_prm_checkpoints_it_and_resumes_with_it(tiny_model_dir, tmp_path, monkeypatch):
    """algo.advantage=prime through the whole loop: the learner builds the PRM and the reference, every step trains
    the PRM and reports it, the checkpoint holds it, and a resumed job loads it (learner/prm.py; its math and what a
    checkpoint restores are in tests/unit/test_prime.py)."""
    monkeypatch.chdir(tmp_path)

    def run(total_steps: int) -> dict:
        return run_scripted_job(tiny_model_dir, tmp_path, ["algo.advantage=prime", "prm.lr=1e-3",
                                                           f"learner.total_steps={total_steps}",
                                                           "learner.checkpoint_every=3"])[0]

    assert run(3)["steps"] == 3
    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    assert json.loads((checkpoint / "meta.json").read_text())["prm"] and (checkpoint / "prm_scheduler.pt").exists()
    resumed = run(4)
    assert resumed["start_version"] == 3 and resumed["steps"] == 1
    rows = [json.loads(line) for line in open(tmp_path / "progress.jsonl")]
    trained = [row for row in rows if "loss/pg" in row]
    assert [row["step"] for row in trained] == [1, 2, 3, 4]
    assert all(row["prm/skipped"] == 0.0 and row["prm/loss"] > 0 for row in trained)
    assert trained[-1]["prm/token_reward/abs_mean"] > 0  # the trained PRM has moved off the reference
