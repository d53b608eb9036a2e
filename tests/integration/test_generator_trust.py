"""A live zmq learner (learner/loop.py, in process) fed by two generators over real sockets: one sends logprobs
no engine of the model produced (-0.01 on every token, where the tiny model gives about -4.16), the other the
model's own. The liar is named in the step's mismatch warning (numbered as the progress log numbers steps),
quarantined once its last learner.quarantine_window_groups trained groups are past learner.quarantine_abs_diff
(learner/trust.py), its further groups are refused, counted under buffer/rejected/quarantined and told to it in its
next reply (with Redis: dead-lettered, the reason in the dead letter); the honest one trains on to the end."""
import json
import logging
import threading
import time
import uuid

import numpy as np
import pytest

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.group import Group, Sample
from tests.conftest import free_port
from tests.integration.helpers import HONEST_LOGPROB, VOCAB, recipe_sampling
from tests.raw_peer import RawPeer

STEPS, B, N, WINDOW = 5, 2, 2, 4
MADE_UP_LOGPROB = -0.01


def job_config(model_dir: str, tmp_path, backend: list):
    from asyncrl.configs import load_config

    return load_config(None, [f"model.path={model_dir}", "demo.task=''", "algo.dynamic_sampling=false",
                              f"learner.total_steps={STEPS}", "weightsync.every_steps=1", "buffer.max_staleness=1",
                              f"buffer.groups_per_step={B}", f"rollout.n={N}", "rollout.max_tokens=10",
                              "learner.checkpoint_every=0", "buffer.done_grace_s=5", "telemetry.progress=false",
                              f"weightsync.shm_dir={tmp_path}", *backend,
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


def quarantined_the_liar_only(tmp_path, caplog, summary: dict, liar_sent: list, honest_sent: list) -> None:
    """Steps 1 and 2 trained the liar's first WINDOW groups, the rest the honest one's; the liar's two later groups
    were refused and counted; the log named it once, and the mismatch warning of step 1 named it too."""
    assert summary["steps"] == STEPS and summary["rejected"] == {"quarantined": 2}
    trained = {gid for line in open(tmp_path / "trained_groups.jsonl") for gid in json.loads(line)["groups"]}
    assert trained == set(liar_sent[:WINDOW]) | set(honest_sent[:(STEPS - 2) * B])
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.learner.trust"]
    quarantines = [line for line in lines if "is quarantined:" in line]
    assert len(quarantines) == 1 and "'liar' is quarantined" in quarantines[0] and "at step 2" in quarantines[0]
    # the honest generator had no trained group yet: the log says no trusted generator is left, and why that may be
    assert [line for line in lines if line not in quarantines] == [
        line for line in lines if "every generator whose groups were trained is quarantined (liar)" in line]
    assert len(lines) == 2
    # the mismatch warning of the liar's first step names it, and calls that step 1 (the first the progress log has)
    first = next(r.getMessage() for r in caplog.records if "token_mult_prob_error" in r.getMessage())
    assert first.startswith("step 1:") and "liar 4." in first, first
    rows = [json.loads(line) for line in open(tmp_path / "progress.jsonl")]
    assert rows[-1]["learner/quarantined_generators"] == 1 and rows[-1]["buffer/rejected/quarantined"] == 2


def test_a_generator_sending_made_up_logprobs_is_quarantined_and_an_honest_one_trains_on(
        tiny_model_dir, tmp_path, monkeypatch, caplog):
    from asyncrl.learner.loop import run_learner

    monkeypatch.chdir(tmp_path)  # MLflow writes run artifacts under the working directory
    port = free_port()
    cfg = job_config(tiny_model_dir, tmp_path, [f"buffer.port={port}"])
    liar = Liar(cfg, f"tcp://127.0.0.1:{port}")
    honest = Honest(cfg, f"tcp://127.0.0.1:{port}", liar)
    liar.start()
    honest.start()
    with caplog.at_level(logging.WARNING):
        summary = run_learner(cfg, tiny_model_dir, [], str(tmp_path))
    liar.join(timeout=30)
    honest.join(timeout=30)
    assert not liar.errors and not honest.errors, (liar.errors, honest.errors)
    quarantined_the_liar_only(tmp_path, caplog, summary, liar.sent, honest.sent)
    assert "quarantined" in liar.rejected[-1]["last_error"] and not honest.rejected


class RedisPeer(threading.Thread):
    """A generator writing the job's Redis keys itself (leases, then the stream), as tests/integration/
    test_hostile_generators.py's RedisHostile; the liar and the honest one play as over zmq."""

    def __init__(self, cfg, url: str, job: str, gen: str, after: threading.Event | None = None):
        super().__init__(daemon=True)
        self.cfg, self.url, self.job, self.gen, self.after = cfg, url, job, gen, after
        self.sent: list[str] = []
        self.errors: list[str] = []
        self.all_sent = threading.Event()
        self.rng = np.random.default_rng(len(gen))

    def run(self):
        from asyncrl.buffer.redis.conn import RedisOptions, connect
        from asyncrl.buffer.redis.coordinator import RedisCoordinator
        from asyncrl.buffer.redis.stream import GroupStream
        from tests.integration.helpers import wait_for_the_learner

        client = connect(RedisOptions(self.url))
        try:
            stream = GroupStream(client, self.job, producer=self.gen)
            wait_for_the_learner(client, stream)
            coordinator = RedisCoordinator(client, self.job, lead=1, groups_per_step=B)
            if self.after is None:  # the liar
                self.send(stream, coordinator, MADE_UP_LOGPROB, WINDOW)
                deadline = time.monotonic() + 60
                while int(client.get(stream.keys["version"]) or 0) < 2:
                    assert time.monotonic() < deadline, "the learner never reached v2"
                    time.sleep(0.02)
                self.send(stream, coordinator, MADE_UP_LOGPROB, 2)
                self.all_sent.set()
            else:
                assert self.after.wait(120), "the liar never finished sending"
                while client.hget(stream.keys["meta"], "done") != b"1":
                    self.send(stream, coordinator, HONEST_LOGPROB, 1)
        except Exception as err:  # surfaced by the test
            self.errors.append(repr(err))
        finally:
            client.close()

    def send(self, stream, coordinator, logprob: float, count: int) -> None:
        for _ in range(count):
            deadline = time.monotonic() + 60
            while not (granted := coordinator.try_admit(self.gen, want=1))[0]:
                if stream.client.hget(stream.keys["meta"], "done") == b"1":
                    return
                assert time.monotonic() < deadline, f"{self.gen} never admitted"
                time.sleep(0.01)
            payload = a_group(self.cfg, self.gen, self.rng, logprob, granted[1])
            stream.produce(json_id(payload), payload, granted[0][0])
            self.sent.append(json_id(payload))


@pytest.mark.redis
def test_with_redis_the_quarantined_generators_entries_are_dead_lettered(redis_server, tiny_model_dir, tmp_path,
                                                                        monkeypatch, caplog):
    from asyncrl.buffer.redis.conn import RedisOptions, connect
    from asyncrl.buffer.redis.stream import GroupStream
    from asyncrl.learner.loop import run_learner

    monkeypatch.chdir(tmp_path)
    job = "trust" + uuid.uuid4().hex[:8]
    cfg = job_config(tiny_model_dir, tmp_path, ["buffer.backend=redis", f"buffer.redis.url={redis_server.url}",
                                                f"buffer.redis.namespace={job}"])
    liar = RedisPeer(cfg, redis_server.url, job, "liar")
    honest = RedisPeer(cfg, redis_server.url, job, "honest", after=liar.all_sent)
    liar.start()
    honest.start()
    with caplog.at_level(logging.WARNING):
        summary = run_learner(cfg, tiny_model_dir, [], str(tmp_path))
    liar.join(timeout=30)
    honest.join(timeout=30)
    assert not liar.errors and not honest.errors, (liar.errors, honest.errors)
    quarantined_the_liar_only(tmp_path, caplog, summary, liar.sent, honest.sent)
    client = connect(RedisOptions(redis_server.url))
    try:
        reasons = [entry[b"reason"].decode() for entry in GroupStream(client, job).dead_letters()]
    finally:
        client.close()
    assert len(reasons) == 2 and all(r.startswith("quarantined: generator 'liar' is quarantined") for r in reasons)
