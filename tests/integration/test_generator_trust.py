"""A live zmq learner (learner/loop.py, in process) fed by two generators over real sockets: one sends logprobs
no engine of the model produced (-0.01 on every token, where the tiny model gives about -4.16), the other the
model's own. The liar is named in the step's mismatch warning (numbered as the progress log numbers steps),
quarantined once its last learner.quarantine_window_groups trained groups are past learner.quarantine_abs_diff
(learner/trust.py), its further groups are refused, counted under buffer/rejected/quarantined and told to it in its
next reply; the honest one trains on to the end."""
import json
import logging
import threading
import time
import uuid

import numpy as np

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.group import Group, Sample
from tests.conftest import free_port
from tests.integration.helpers import HONEST_LOGPROB, VOCAB, recipe_sampling
from tests.raw_peer import RawPeer

STEPS, B, N, WINDOW = 5, 2, 2, 4
MADE_UP_LOGPROB = -0.01


def job_config(model_dir: str, tmp_path, port: int):
    from asyncrl.configs import load_config

    return load_config(None, [f"model.path={model_dir}", "demo.task=''", "algo.dynamic_sampling=false",
                              f"learner.total_steps={STEPS}", "weightsync.every_steps=1", "buffer.max_staleness=1",
                              f"buffer.groups_per_step={B}", f"rollout.n={N}", "rollout.max_tokens=10",
                              "learner.checkpoint_every=0", "buffer.done_grace_s=5", "telemetry.progress=false",
                              f"weightsync.shm_dir={tmp_path}", f"buffer.port={port}",
                              f"telemetry.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
                              f"learner.quarantine_window_groups={WINDOW}"])


def a_group(cfg, gen: str, rng, logprob: float, version: int) -> bytes:
    samples = [Sample(completion_ids=rng.integers(2, VOCAB, 4).astype(np.int32),
                      logprobs=np.full(4, logprob, np.float32), versions=np.full(4, version, np.int32),
                      reward=float(reward), finish_reason="stop") for reward in (0, 1)]
    return encode_group(Group(group_id=uuid.uuid4().hex, prompt_id="p", generator_id=gen,
                              prompt_ids=rng.integers(2, VOCAB, 3).astype(np.int32), samples=samples,
                              sampling=recipe_sampling(cfg), created_at=time.time()))


class Peer(threading.Thread):
    """A generator over a raw DEALER socket; `sent` holds its group ids in order, `rejected` what its replies said."""

    def __init__(self, cfg, endpoint: str, gen: str):
        super().__init__(daemon=True)
        self.cfg, self.endpoint, self.gen = cfg, endpoint, gen
        self.sent: list[str] = []
        self.rejected: list[dict] = []
        self.errors: list[str] = []
        self.version = 0
        self.rng = np.random.default_rng(len(gen))

    def ask(self, peer: RawPeer, op: str, *bodies, **fields) -> dict:
        reply = peer.ask(op, *bodies, wait_ms=60_000, **fields)  # the first waits for the learner's start
        self.version = max(self.version, reply.get("version", 0))
        if "rejected" in reply:
            self.rejected.append(reply["rejected"])
        return reply

    def send(self, peer: RawPeer, logprob: float) -> dict:
        deadline = time.monotonic() + 60
        while not (reply := self.ask(peer, "admit", want=1))["granted"]:
            if reply["done"]:
                return reply
            assert time.monotonic() < deadline, f"{self.gen} never admitted"
            time.sleep(0.01)
        payload = a_group(self.cfg, self.gen, self.rng, logprob, self.version)
        self.sent.append(json_id(payload))
        return self.ask(peer, "group", payload)

    def run(self):
        peer = RawPeer(self.endpoint, self.gen)
        try:
            self.talk(peer)
        except Exception as err:  # surfaced by the test
            self.errors.append(repr(err))
        finally:
            peer.close()


class Liar(Peer):
    """WINDOW groups (steps 1 and 2 train them), then, once v2 is out (it was judged after step 2), two more; then
    asks until a reply tells it why they were refused."""

    def __init__(self, cfg, endpoint: str):
        super().__init__(cfg, endpoint, "liar")
        self.all_sent = threading.Event()

    def talk(self, peer: RawPeer) -> None:
        for _ in range(WINDOW):
            self.send(peer, MADE_UP_LOGPROB)
        deadline = time.monotonic() + 60
        while self.ask(peer, "stats", metrics={})["version"] < 2:
            assert time.monotonic() < deadline, "the learner never reached v2"
            time.sleep(0.02)
        for _ in range(2):
            self.send(peer, MADE_UP_LOGPROB)
        self.all_sent.set()
        while sum(told["count"] for told in self.rejected) < 2:
            assert time.monotonic() < deadline, f"never told of its refused groups: {self.rejected}"
            self.ask(peer, "stats", metrics={})
            time.sleep(0.02)
        self.ask(peer, "bye")  # gone, so the end of the job does not wait for it


class Honest(Peer):
    """Starts once the liar has sent everything (so the queue's order fixes which step takes what), then sends the
    model's own logprobs until the job is done."""

    def __init__(self, cfg, endpoint: str, liar: Liar):
        super().__init__(cfg, endpoint, "honest")
        self.liar = liar

    def talk(self, peer: RawPeer) -> None:
        assert self.liar.all_sent.wait(120), "the liar never finished sending"
        while not self.send(peer, HONEST_LOGPROB).get("done"):
            pass


def json_id(payload: bytes) -> str:
    import msgpack

    return msgpack.unpackb(payload, raw=False)["group_id"]


def test_a_generator_sending_made_up_logprobs_is_quarantined_and_an_honest_one_trains_on(
        tiny_model_dir, tmp_path, monkeypatch, caplog):
    from asyncrl.learner.loop import run_learner

    monkeypatch.chdir(tmp_path)  # MLflow writes run artifacts under the working directory
    port = free_port()
    cfg = job_config(tiny_model_dir, tmp_path, port)
    liar = Liar(cfg, f"tcp://127.0.0.1:{port}")
    honest = Honest(cfg, f"tcp://127.0.0.1:{port}", liar)
    liar.start()
    honest.start()
    with caplog.at_level(logging.WARNING):
        summary = run_learner(cfg, tiny_model_dir, [], str(tmp_path))
    liar.join(timeout=30)
    honest.join(timeout=30)
    assert not liar.errors and not honest.errors, (liar.errors, honest.errors)
    assert summary["steps"] == STEPS and summary["rejected"] == {"quarantined": 2}
    trained = {gid for line in open(tmp_path / "trained_groups.jsonl") for gid in json.loads(line)["groups"]}
    assert trained == set(liar.sent[:WINDOW]) | set(honest.sent[:(STEPS - 2) * B])
    assert "quarantined" in liar.rejected[-1]["last_error"] and not honest.rejected
    quarantines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.learner.trust"]
    assert len(quarantines) == 1 and "'liar' is quarantined" in quarantines[0] and "at step 2" in quarantines[0]
    # the mismatch warning of the liar's first step names it, and calls that step 1 (the first the progress log has)
    first = next(r.getMessage() for r in caplog.records if "token_mult_prob_error" in r.getMessage())
    assert first.startswith("step 1:") and "liar 4." in first, first
    rows = [json.loads(line) for line in open(tmp_path / "progress.jsonl")]
    assert rows[-1]["learner/quarantined_generators"] == 1 and rows[-1]["buffer/rejected/quarantined"] == 2
