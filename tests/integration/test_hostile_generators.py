"""A live learner (learner/loop.py, in process) fed by a generator that breaks every rule we could think of, on
zmq and on a real redis-server. Each hostile group decodes cleanly or nearly so (the decoder alone caught all but
these): a temperature of 0, a reward of 1e300, an empty prompt, thousands of samples, a 1000-token completion,
logprobs of -1e38 or NaN, a sample with no token that says it stopped, another generator's id, a group from a future version, groups nobody asked for, an
oversized frame, a stats report that is not numbers, and one group whose rewards (±3e38) are finite in float32 but
overflow the loss. The learner keeps training to the end, trains none of them, counts each under
buffer/rejected/<reason>, skips the one step the huge rewards poison, and publishes only finite weights. Every step
poisoned stops the job with TrainingPoisoned; a Redis entry each learner incarnation dies on is dead-lettered after
max_deliveries, and a step that fails with an unknown error dead-letters its groups before the job stops."""
import asyncio
import json
import threading
import time
import uuid

import msgpack
import numpy as np
import pytest
import torch

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.group import Group, Sample, Sampling
from tests.conftest import free_port
from tests.integration.helpers import HONEST_LOGPROB, VOCAB, recipe_sampling, wait_for_the_learner
from tests.messages import run_info
from tests.raw_peer import RawPeer

LIMIT = 1 << 20  # buffer.max_message_bytes in these jobs
STEPS, B, N = 3, 2, 2


def job_config(model_dir: str, tmp_path, backend: list, steps: int = STEPS):
    from asyncrl.configs import load_config

    return load_config(None, [f"model.path={model_dir}", "demo.task=''", "algo.dynamic_sampling=false",
                              f"learner.total_steps={steps}",
                              "weightsync.every_steps=1", "buffer.max_staleness=1", f"buffer.groups_per_step={B}",
                              f"rollout.n={N}", "rollout.max_tokens=10", "learner.checkpoint_every=0",
                              "buffer.done_grace_s=5", "telemetry.progress=false", f"weightsync.shm_dir={tmp_path}",
                              f"buffer.max_message_bytes={LIMIT}", "algo.norm_adv_by_std=false",
                              f"telemetry.tracking_uri=sqlite:///{tmp_path}/mlflow.db", *backend])


def a_group(cfg, gen: str, rng, rewards=None, version: int = 0) -> Group:
    """What a generator of this job produces: rollout.n completions sampled with the recipe's settings."""
    rewards = [float(r) for r in rng.integers(0, 2, N)] if rewards is None else rewards
    samples = [Sample(completion_ids=rng.integers(2, VOCAB, 4).astype(np.int32), logprobs=np.full(4, HONEST_LOGPROB, np.float32),
                      versions=np.full(4, version, np.int32), reward=reward, finish_reason="stop")
               for reward in rewards]
    return Group(group_id=uuid.uuid4().hex, prompt_id="p", generator_id=gen,
                 prompt_ids=rng.integers(2, VOCAB, 3).astype(np.int32), samples=samples,
                 sampling=recipe_sampling(cfg), created_at=time.time())


def rewritten(group: Group, **fields) -> bytes:
    """The group's bytes with wire fields replaced (what a generator that skips encode_group can send)."""
    wire = msgpack.unpackb(encode_group(group), raw=False)
    return msgpack.packb(wire | fields, use_bin_type=True)


def hostile_groups(cfg, gen: str) -> list[tuple[str, str, bytes]]:
    """(what it is, the reason it must be rejected for, its bytes); each is sent after an admission."""
    rng = np.random.default_rng(7)

    def with_(change) -> bytes:
        group = a_group(cfg, gen, rng)
        change(group)
        return encode_group(group)

    def sampling(**fields):
        return lambda g: setattr(g, "sampling", Sampling(**{**vars(recipe_sampling(cfg)), **fields}))

    def sample_field(name, value):
        return lambda g: setattr(g.samples[0], name, value)

    one = a_group(cfg, gen, rng)
    wire_sample = msgpack.unpackb(encode_group(one), raw=False)["samples"][0]
    long_ids = np.full(1000, 3, np.int32)
    return [
        ("temperature 0 (divides the logits by 0)", "sampling", with_(sampling(temperature=0.0))),
        ("temperature -1", "sampling", with_(sampling(temperature=-1.0))),
        ("temperature 1e-30", "sampling", with_(sampling(temperature=1e-30))),
        ("another top_k", "sampling", with_(sampling(top_k=5))),
        ("reward 1e300 (inf in float32)", "bad_reward", with_(sample_field("reward", 1e300))),
        ("reward_info 1e300", "bad_reward", with_(sample_field("reward_info", {"x": 1e300}))),
        ("baseline 1e300", "bad_reward", with_(lambda g: g.meta.update(baseline_reward=1e300))),
        ("empty prompt (crashed batch assembly)", "empty", with_(lambda g: setattr(g, "prompt_ids",
                                                                                  np.zeros(0, np.int32)))),
        ("5000 samples", "group_size", rewritten(one, group_id=uuid.uuid4().hex, samples=[wire_sample] * 5000)),
        ("one sample of rollout.n=2", "group_size", rewritten(one, group_id=uuid.uuid4().hex,
                                                              samples=[wire_sample])),
        ("1000-token completion", "too_long", with_(lambda g: g.samples.__setitem__(0, Sample(
            completion_ids=long_ids, logprobs=np.full(1000, -1.0, np.float32), versions=np.zeros(1000, np.int32),
            reward=1.0, finish_reason="length")))),
        ("65-token prompt", "too_long", with_(lambda g: setattr(g, "prompt_ids", np.full(65, 3, np.int32)))),
        ("logprob -1e38", "bad_logprob", with_(lambda g: g.samples[0].logprobs.__setitem__(0, -1e38))),
        ("logprob NaN", "bad_logprob", with_(lambda g: g.samples[0].logprobs.__setitem__(0, np.nan))),
        ("token out of the vocabulary", "token_out_of_range",
         with_(lambda g: g.samples[0].completion_ids.__setitem__(0, VOCAB + 5))),
        ("negative version", "bad_version", with_(lambda g: g.samples[0].versions.__setitem__(0, -1))),
        ("no token, yet 'stop', beside a real sample", "bad_finish_reason", with_(lambda g: g.samples.__setitem__(
            1, Sample(completion_ids=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32),
                      versions=np.zeros(0, np.int32), reward=1.0, finish_reason="stop")))),
        ("another generator's id", "generator_id", with_(lambda g: setattr(g, "generator_id", "honest"))),
    ]


def unrequested_groups(cfg, gen: str, count: int) -> list[bytes]:
    """Bad groups (temperature 0) sent without asking for an admission: rejecting them must free none."""
    rng = np.random.default_rng(11)
    groups = [a_group(cfg, gen, rng) for _ in range(count)]
    for group in groups:
        group.sampling = Sampling(**{**vars(recipe_sampling(cfg)), "temperature": 0.0})
    return [encode_group(group) for group in groups]


def expected_rejections(cfg, gen: str, unrequested: int) -> dict:
    counts: dict = {}
    for _, reason, _ in hostile_groups(cfg, gen):
        counts[reason] = counts.get(reason, 0) + 1
    counts["sampling"] += unrequested
    return counts | {"too_large": 1, "stats": 1, "poisoned_step": B}


def poison_group(cfg, gen: str, rng) -> Group:
    """Valid by every rule (each reward is a finite float32), yet with Dr. GRPO's unnormalized advantages the loss
    overflows: only the NaN guard stops it."""
    return a_group(cfg, gen, rng, rewards=[3e38, -3e38])


class Honest(threading.Thread):
    """The job's real generator (after the hostile one is done): samples each admitted group with the newest
    version, and stages every version it hears of (weightsync/receiver.py) to check the published weights."""

    def __init__(self, cfg, client, config_hash: str, shm_dir: str, after: threading.Thread):
        super().__init__(daemon=True)
        self.cfg, self.client, self.config_hash, self.after = cfg, client, config_hash, after
        self.shm_dir = shm_dir
        self.sent: list[str] = []
        self.versions_checked: list[int] = []
        self.non_finite: list[str] = []
        self.errors: list[str] = []

    def run(self):
        self.after.join()
        try:
            asyncio.run(self.generate())
        except Exception as err:  # surfaced by the test
            self.errors.append(repr(err))
        finally:
            self.client.close()

    async def generate(self):
        from asyncrl.weightsync.receiver import WeightStage

        stage, rng = WeightStage(self.shm_dir, "honest-probe"), np.random.default_rng(1)
        try:
            reply = await self.client.hello(self.config_hash)
            while not reply.done:
                self.check_weights(stage, reply.weights)
                reply = await self.client.admit(1)
                if not reply.granted:
                    await asyncio.sleep(0.01)
                    continue
                group = a_group(self.cfg, "honest", rng, version=max(self.versions_checked, default=0))
                reply = await self.client.send(group.group_id, encode_group(group))
                self.sent.append(group.group_id)
        finally:
            stage.close()

    def check_weights(self, stage, message) -> None:
        if message is None or message.version in self.versions_checked:
            return
        version = message.version
        staged = stage.stage(message)
        self.non_finite += [f"v{version} {name}" for name, tensor in staged.buckets.tensors()
                            if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
        stage.end_load(staged, ok=True)
        self.versions_checked.append(version)


class ZmqHostile(threading.Thread):
    """A generator written by someone else, over a raw DEALER socket."""

    def __init__(self, cfg, endpoint: str, unrequested: int):
        super().__init__(daemon=True)
        self.cfg, self.endpoint, self.unrequested = cfg, endpoint, unrequested
        self.sent: list[str] = []
        self.replies: dict = {}
        self.errors: list[str] = []

    def run(self):
        peer = RawPeer(self.endpoint, "hostile")
        try:
            rng = np.random.default_rng(3)
            for label, _, payload in hostile_groups(self.cfg, "hostile"):
                self.admitted(peer)
                self.replies[label] = peer.ask("group", payload)
                self.sent.append(group_id_of(payload))
            for payload in unrequested_groups(self.cfg, "hostile", self.unrequested):
                peer.ask("group", payload)
                self.sent.append(group_id_of(payload))
            self.replies["future version"] = self.send_admitted(peer, a_group(self.cfg, "hostile", rng, version=99))
            self.replies["oversized"] = peer.ask("group", b"\x00" * (LIMIT + (3 << 19)))
            self.replies["stats"] = peer.ask("stats", metrics={"perf/generator/tokens_per_s": "fast"})
            self.replies["poison"] = self.send_admitted(peer, poison_group(self.cfg, "hostile", rng))
            peer.ask("bye")  # gone, so the end of the job does not wait for it
        except Exception as err:
            self.errors.append(repr(err))
        finally:
            peer.close()

    def send_admitted(self, peer: RawPeer, group: Group) -> dict:
        self.admitted(peer)
        self.sent.append(group.group_id)
        return peer.ask("group", encode_group(group))

    @staticmethod
    def admitted(peer: RawPeer) -> None:
        deadline = time.monotonic() + 60
        # each rejected group's admission comes back; the first admit may wait for the learner's start (the model
        # load, under CI's load), which a 10 s reply wait did not always cover
        while not peer.ask("admit", want=1, wait_ms=60_000)["granted"]:
            assert time.monotonic() < deadline, "never admitted"
            time.sleep(0.01)


def trained_ids(job_dir) -> set:
    return {gid for line in open(job_dir / "trained_groups.jsonl") for gid in json.loads(line)["groups"]}


def group_id_of(payload: bytes) -> str:
    return msgpack.unpackb(payload, raw=False)["group_id"]


def trained_to_the_end_on_honest_groups_only(cfg, job_dir, hostile, honest, summary: dict) -> None:
    """Every step trained, on honest groups only; every hostile group counted under its reason; the one poisoned
    step skipped; no group staler than η; every published version staged by the honest generator was finite."""
    honest.join(timeout=30)
    assert not hostile.errors and not honest.errors, (hostile.errors, honest.errors)
    assert summary["steps"] == STEPS
    assert summary["rejected"] == expected_rejections(cfg, "hostile", unrequested=10)
    trained = trained_ids(job_dir)
    assert len(trained) == STEPS * B and trained <= set(honest.sent)
    assert len(hostile.sent) == len(hostile_groups(cfg, "hostile")) + 12 and not trained & set(hostile.sent)
    rows = [json.loads(line) for line in open(job_dir / "progress.jsonl")]
    assert rows[-1]["learner/skipped_steps"] == 1 and rows[-1]["buffer/dropped/future_version"] == 1
    assert max(row["buffer/staleness/max"] for row in rows) <= 1
    # The versions it heard of, in order, up to the last step's. It may hear of none between two: the learner runs in
    # this process, and under load two steps can pass between the probe's turns at the GIL. NaN weights stay NaN
    # under AdamW, so finite later versions also speak for a skipped one.
    checked = honest.versions_checked
    assert checked[0] == 0 and checked == sorted(set(checked)) and checked[-1] >= STEPS - 1, checked
    assert not honest.non_finite


def test_a_live_zmq_learner_survives_every_hostile_group_and_trains_none(tiny_model_dir, tmp_path, monkeypatch):
    from asyncrl.buffer.backends import make_generator_buffer
    from asyncrl.configs import shared_hash
    from asyncrl.learner.loop import run_learner

    monkeypatch.chdir(tmp_path)  # MLflow writes run artifacts under the working directory
    port = free_port()
    cfg = job_config(tiny_model_dir, tmp_path, [f"buffer.port={port}"])
    hostile = ZmqHostile(cfg, f"tcp://127.0.0.1:{port}", unrequested=10)
    honest = Honest(cfg, make_generator_buffer(cfg.buffer, cfg.security, cfg.job.name, "honest"), shared_hash(cfg), str(tmp_path), after=hostile)
    hostile.start()
    honest.start()
    trained_to_the_end_on_honest_groups_only(cfg, tmp_path, hostile, honest,
                                             run_learner(cfg, tiny_model_dir, [], str(tmp_path)))
    assert hostile.replies["oversized"]["reason"] == "too_large" and not hostile.replies["stats"]["ok"]


@pytest.mark.redis
def test_a_live_redis_learner_survives_every_hostile_entry_and_dead_letters_each(redis_server, tiny_model_dir,
                                                                                 tmp_path, monkeypatch):
    from asyncrl.buffer.backends import make_generator_buffer
    from asyncrl.buffer.redis.conn import RedisOptions, connect
    from asyncrl.configs import shared_hash
    from asyncrl.learner.loop import run_learner

    monkeypatch.chdir(tmp_path)
    job = "hostile" + uuid.uuid4().hex[:8]
    cfg = job_config(tiny_model_dir, tmp_path, ["buffer.backend=redis", f"buffer.redis.url={redis_server.url}",
                                                f"buffer.redis.namespace={job}"])
    hostile = RedisHostile(cfg, connect(RedisOptions(redis_server.url)), job, unrequested=10)
    honest = Honest(cfg, make_generator_buffer(cfg.buffer, cfg.security, cfg.job.name, "honest"), shared_hash(cfg), str(tmp_path), after=hostile)
    hostile.start()
    honest.start()
    trained_to_the_end_on_honest_groups_only(cfg, tmp_path, hostile, honest,
                                             run_learner(cfg, tiny_model_dir, [], str(tmp_path)))
    from asyncrl.buffer.redis.stream import GroupStream

    dead = GroupStream(hostile.client, job).dead_letters()
    reasons = [entry[b"reason"].decode().split(":")[0] for entry in dead]
    expected = expected_rejections(cfg, "hostile", unrequested=10)
    del expected["stats"]  # a report, not an entry
    assert {reason: reasons.count(reason) for reason in set(reasons)} == expected
    oversized = next(entry for entry in dead if entry[b"reason"].startswith(b"too_large"))
    assert int(oversized[b"size"]) == LIMIT + (3 << 19) and len(oversized[b"payload"]) == 64 << 10
    hostile.client.close()


class RedisHostile(threading.Thread):
    """A generator written by someone else, writing the job's Redis keys itself."""

    def __init__(self, cfg, client, job: str, unrequested: int):
        super().__init__(daemon=True)
        self.cfg, self.client, self.job, self.unrequested = cfg, client, job, unrequested
        self.sent: list[str] = []
        self.errors: list[str] = []

    def run(self):
        from asyncrl.buffer.redis.coordinator import RedisCoordinator
        from asyncrl.buffer.redis.stream import GroupStream

        try:
            stream = GroupStream(self.client, self.job, producer="hostile")
            wait_for_the_learner(self.client, stream)
            coordinator = RedisCoordinator(self.client, self.job, lead=1, groups_per_step=B)
            rng = np.random.default_rng(3)
            for _, _, payload in hostile_groups(self.cfg, "hostile"):
                stream.produce(group_id_of(payload), payload, self.lease(coordinator))
                self.sent.append(group_id_of(payload))
            for payload in unrequested_groups(self.cfg, "hostile", self.unrequested):
                stream.produce(group_id_of(payload), payload)
                self.sent.append(group_id_of(payload))
            for group in (a_group(self.cfg, "hostile", rng, version=99), poison_group(self.cfg, "hostile", rng)):
                stream.produce(group.group_id, encode_group(group), self.lease(coordinator))
                self.sent.append(group.group_id)
            stream.produce(uuid.uuid4().hex, b"\x00" * (LIMIT + (3 << 19)))
            self.client.hset(stream.keys["meta"] + ":stats", "hostile", b"{not json")
        except Exception as err:
            self.errors.append(repr(err))

    @staticmethod
    def lease(coordinator) -> str:
        deadline = time.monotonic() + 60
        while not (leases := coordinator.try_admit("hostile", want=1)[0]):
            assert time.monotonic() < deadline, "never admitted"
            time.sleep(0.01)
        return leases[0]


def test_a_job_whose_every_step_is_poisoned_stops_with_a_clear_error(tiny_model_dir, tmp_path, monkeypatch):
    from asyncrl.learner.loop import TrainingPoisoned, run_learner

    monkeypatch.chdir(tmp_path)
    port = free_port()
    cfg = job_config(tiny_model_dir, tmp_path, [f"buffer.port={port}"], steps=10)
    stop = threading.Event()

    def poisoner():
        peer, rng = RawPeer(f"tcp://127.0.0.1:{port}", "poisoner"), np.random.default_rng(0)
        try:
            peer.ask("admit", want=0, wait_ms=120_000)  # answered once the learner is up
            while not stop.is_set():
                if peer.ask("admit", want=1, wait_ms=2000).get("granted"):
                    peer.ask("group", encode_group(poison_group(cfg, "poisoner", rng)), wait_ms=2000)
                else:
                    time.sleep(0.01)
        except AssertionError:  # no answer: the learner has stopped
            pass
        finally:
            peer.close()

    thread = threading.Thread(target=poisoner, daemon=True)
    thread.start()
    try:
        with pytest.raises(TrainingPoisoned, match=r"3 steps in a row at v0 could not train"):
            run_learner(cfg, tiny_model_dir, [], str(tmp_path))
    finally:
        stop.set()
        thread.join(timeout=15)
    assert not (tmp_path / "trained_groups.jsonl").exists() or not trained_ids(tmp_path)


@pytest.mark.redis
def test_an_entry_every_learner_incarnation_dies_on_is_dead_lettered_after_max_deliveries(redis_server):
    """A hard crash inside a step (an OOM kill, a segfault) leaves the entry pending: each resumed learner re-reads
    it, and each re-read counts, so after max_deliveries it goes to the dead-letter stream with its reason, its
    admission comes back, and the next learner carries on. Before, pending re-reads were not counted: a crash
    loop."""
    from asyncrl.buffer.redis.conn import RedisOptions, connect
    from asyncrl.buffer.redis.coordinator import RedisCoordinator
    from asyncrl.buffer.redis.server import RedisBufferServer
    from asyncrl.buffer.redis.stream import GroupStream

    job = "loop" + uuid.uuid4().hex[:8]
    url = redis_server.url

    def incarnation():
        client = connect(RedisOptions(url))
        coordinator = RedisCoordinator(client, job, lead=0, groups_per_step=4)
        server = RedisBufferServer(client, url, job, coordinator, vocab_size=VOCAB, config_hash="h",
                                   max_message_bytes=LIMIT, run_info=run_info())
        server.start()
        return server

    first = incarnation()
    writer = GroupStream(connect(RedisOptions(url)), job, producer="gen")
    lease = first.coordinator.try_admit("gen", want=1)[0][0]
    sample = Sample(completion_ids=np.array([3, 4], np.int32), logprobs=np.full(2, -0.5, np.float32),
                    versions=np.zeros(2, np.int32), reward=1.0, finish_reason="stop")
    group = Group(group_id="crash", prompt_id="p", generator_id="gen", prompt_ids=np.array([5], np.int32),
                  samples=[sample], sampling=Sampling(1.0), created_at=time.time())
    writer.produce("crash", encode_group(group), lease)
    taken = [first.take(2.0).group_id]
    first.close()  # died in the step: never acked
    for _ in range(first.stream.max_deliveries - 1):
        server = incarnation()
        taken.append(server.take(2.0).group_id)
        server.close()
    last = incarnation()
    try:
        assert last.take(0.5) is None
        assert taken == ["crash"] * first.stream.max_deliveries
        dead = last.stream.dead_letters()
        assert len(dead) == 1 and dead[0][b"reason"].startswith(b"max_deliveries: delivered 6 times")
        assert last.rejected == {"max_deliveries": 1}
        assert last.coordinator.started == 0 and last.stream.pending_count() == 0  # its admission came back
    finally:
        last.close()
        writer.client.close()


@pytest.mark.redis
def test_a_step_that_fails_unexpectedly_dead_letters_its_groups_before_the_learner_stops(
        redis_server, tiny_model_dir, tmp_path, monkeypatch):
    """An error the NaN guard does not know (a bug only this batch finds) still stops the job, but its groups are
    dead-lettered first: nothing is left pending for a restarted learner to fail on again."""
    import asyncrl.learner.loop as loop
    from asyncrl.buffer.redis.conn import RedisOptions, connect
    from asyncrl.buffer.redis.coordinator import RedisCoordinator
    from asyncrl.buffer.redis.stream import GroupStream

    real_step = loop.train_step

    def fails_on_crash_prompts(model, optimizer, scheduler, groups, *args, **kwargs):
        if any(group.prompt_id == "crash" for group in groups):
            raise RuntimeError("a bug only this batch finds")
        return real_step(model, optimizer, scheduler, groups, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", fails_on_crash_prompts)  # the fault injected; the learner is real
    monkeypatch.chdir(tmp_path)
    job = "fail" + uuid.uuid4().hex[:8]
    cfg = job_config(tiny_model_dir, tmp_path, ["buffer.backend=redis", f"buffer.redis.url={redis_server.url}",
                                                f"buffer.redis.namespace={job}"])
    client = connect(RedisOptions(redis_server.url))
    stream = GroupStream(client, job, producer="gen")

    def produce():
        wait_for_the_learner(client, stream)
        coordinator, rng = RedisCoordinator(client, job, lead=1, groups_per_step=B), np.random.default_rng(0)
        for _ in range(B):
            group = a_group(cfg, "gen", rng)
            group.prompt_id = "crash"
            stream.produce(group.group_id, encode_group(group), RedisHostile.lease(coordinator))

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        with pytest.raises(RuntimeError, match="a bug only this batch finds"):
            loop.run_learner(cfg, tiny_model_dir, [], str(tmp_path))
        producer.join(timeout=30)
        dead = stream.dead_letters()
        assert [entry[b"reason"].split(b":")[0] for entry in dead] == [b"failed_step"] * B
        assert stream.pending_count() == 0  # a restarted learner has nothing of them to re-read
        assert RedisCoordinator(client, job, lead=1, groups_per_step=B).started == 0  # admissions back
    finally:
        client.close()
