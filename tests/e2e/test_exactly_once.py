"""Every prompt of an epoch is trained exactly once: the learner deals the prompts (buffer/dealing.py; with Redis
the cursor lives in Redis, buffer/redis/dealing.py) to two real generators; one is killed with -9 while it holds
prompts, then the learner is killed with -9 after a checkpoint and resumed, with the generators started again. The
job ends when the epoch (data.epochs=1) is trained, and the learner's trained_groups.jsonl, read as the final model
saw it, lists every prompt of the file once. Both backends. With Redis every process runs as the job's
least-privilege Redis user, and the first learner evaluates held-out prompts on the fleet through Redis
(buffer/redis/eval_bridge.py) before it trains."""
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from asyncrl.security.curve import make_keys

from tests.conftest import free_port
from tests.e2e.jobs import QUIET_TELEMETRY, effective_prompts, job_env, read_progress, subset_parquet
from tests.integration.helpers import create_job_user, denials, user_url

pytestmark = pytest.mark.slow

PROMPTS = 24
GROUPS_PER_STEP = 4


@contextlib.contextmanager
def job_state(request, namespace: str):
    """(a client of the test's redis-server, the job's keys), to read the dealing state the learner keeps there."""
    import redis

    from asyncrl.buffer.redis.stream import job_keys

    client = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
    try:
        yield client, job_keys(namespace)
    finally:
        client.close()


def undelivered_deals(request, namespace: str, generator_id: str) -> list:
    """The deals out to `generator_id` whose groups it has not delivered (delivery takes a deal out of `out`)."""
    with job_state(request, namespace) as (client, keys):
        return [deal for deal in client.zrange(keys["data_out"], 0, -1)
                if client.hget(keys["data_holder"], deal) == generator_id.encode()]


def newest_checkpoint(job_dir) -> dict:
    """The step of the newest complete checkpoint and how many prompts were out (dealt, not trained) in it."""
    step = max(int(path.parent.name.split("-")[1]) for path in (job_dir / "checkpoints").glob("step-*/meta.json"))
    meta = json.loads((job_dir / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text())
    return {"step": step, "out": len(meta["state"]["data_cursor"]["out"])}


def wait_for(condition, proc, log_path, timeout_s=240):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, open(log_path).read()[-3000:]
        assert time.monotonic() < deadline, open(log_path).read()[-3000:]
        time.sleep(0.2)


@pytest.mark.parametrize("backend", ["zmq", pytest.param("redis", marks=pytest.mark.redis)])
def test_two_generators_a_generator_kill_9_and_a_learner_restart_train_each_prompt_once(demo_assets, tmp_path,
                                                                                         backend, request):
    model_dir, files = demo_assets
    expected = subset_parquet(files[0], str(tmp_path / "epoch.parquet"), PROMPTS)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    # done_grace_s: a generator restarted as the resumed learner trains the last prompts may still be starting its
    # engine; the learner keeps answering until it has heard "done" (generator/main.py asks again before loading)
    overrides = [f"model.path={model_dir}", "demo.task=''", f"data.train_files=[{tmp_path / 'epoch.parquet'}]",
                 "data.epochs=1", "learner.total_steps=100", f"buffer.port={free_port()}", "buffer.max_staleness=1",
                 f"buffer.groups_per_step={GROUPS_PER_STEP}", "rollout.n=2", "rollout.max_tokens=8",
                 "algo.dynamic_sampling=false", "generator.engine=hf", "generator.max_inflight_groups=2",
                 "generator.log_every_s=1", "learner.checkpoint_every=2", "learner.torch_threads=1",
                 "buffer.done_grace_s=30", "buffer.request_timeout_s=5", "telemetry.progress=false",
                 *QUIET_TELEMETRY]
    first_learner = []  # the first learner's extra settings
    if backend == "redis":  # a generator silent for buffer.redis.lease_s gives its dealt prompts back
        import pyarrow.parquet as pq

        from asyncrl.buffer.redis.conn import RedisOptions, connect

        namespace = f"once{uuid.uuid4().hex[:8]}"
        redis_server = request.getfixturevalue("redis_server")
        admin = connect(RedisOptions(redis_server.url))
        user, password = create_job_user(admin, namespace)
        overrides += ["buffer.backend=redis", f"buffer.redis.url={user_url(redis_server, user, password)}",
                      f"buffer.redis.namespace={namespace}", "buffer.redis.lease_s=5"]
        pq.write_table(pq.read_table(files[0]).slice(PROMPTS, 4), tmp_path / "heldout.parquet")  # none trained on
        first_learner = [f"eval.files=[{tmp_path / 'heldout.parquet'}]", "eval.before_train=true", "eval.n=1"]
    else:  # the zmq job runs with CURVE keys: every request of both lives is encrypted and authenticated
        make_keys(str(tmp_path / "keys"), ["generator"])
        overrides += [f"security.keys_dir={tmp_path / 'keys'}"]
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir), "PYTHONUNBUFFERED": "1"}
    procs = {}
    held_when_killed = {}  # redis: generator -> its deals not yet delivered when it was killed

    def start(role, name, extra=()):
        log_path = tmp_path / f"{name}.log"
        ids = [f"generator.generator_id={name}"] if role == "generator" else []
        procs[name] = subprocess.Popen([sys.executable, "-m", "asyncrl.launch.cli", role, *extra, *overrides, *ids],
                                       cwd=tmp_path, env=env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
        return procs[name], log_path

    def steps_done():
        return len(read_progress(job_dir)) if (job_dir / "progress.jsonl").exists() else 0

    try:
        learner, learner_log = start("learner", "learner", extra=first_learner)
        start("generator", "a")
        start("generator", "b")
        wait_for(lambda: steps_done() >= 1, learner, learner_log)
        procs["b"].send_signal(signal.SIGKILL)  # most often holding dealt prompts (not always: a deal is out for
        # only as long as its group takes, and under load b may not have started before a made the first groups)
        procs["b"].wait()
        if backend == "redis":
            held_when_killed["b"] = undelivered_deals(request, namespace, "b")
        wait_for(lambda: (job_dir / "checkpoints" / "step-00000002" / "meta.json").exists(), learner, learner_log)
        learner.send_signal(signal.SIGKILL)
        learner.wait()
        resumed_from = newest_checkpoint(job_dir)  # the resumed learner's, read now: later ones rotate it away
        procs["a"].send_signal(signal.SIGKILL)  # it would only wait out its request timeout
        procs["a"].wait()
        if backend == "redis":
            held_when_killed["a"] = undelivered_deals(request, namespace, "a")
        learner, learner_log = start("learner", "learner-2", extra=["--resume"])
        start("generator", "a-2")
        start("generator", "b-2")
        for name in ("learner-2", "a-2", "b-2"):
            assert procs[name].wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    timeline = effective_prompts(job_dir / "trained_groups.jsonl")
    trained = [prompt for step in sorted(timeline) for prompt in timeline[step]]
    assert sorted(trained) == sorted(expected), (len(trained), len(set(trained)))  # each once, none left out
    assert sorted(timeline) == list(range(1, PROMPTS // GROUPS_PER_STEP + 1))  # the job ended with the epoch
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["start_version"] >= 2
    last = read_progress(job_dir)[-1]
    assert last["data/epoch"] == pytest.approx(1.0)
    if backend == "zmq":  # the prompts out at the checkpoint resumed from (b's among them) were dealt again
        assert last["data/consumed"] == PROMPTS and summary["start_version"] == resumed_from["step"]
        assert last.get("data/returned/restart", 0) == resumed_from["out"]
        assert last["buffer/refused_connections"] == 0  # every process presented its CURVE key
    else:  # the cursor lived in Redis: the prompts b and a held came back when they fell silent (a live generator
        # silent for buffer.redis.lease_s under load may lose its deals too, so this is a floor)
        assert last.get("data/returned/generator_gone", 0) >= sum(
            len(deals) for deals in held_when_killed.values()), held_when_killed
        with job_state(request, namespace) as (client, keys):
            # consumed as the final checkpoint acked the last groups; nothing is left dealt, ready or returned
            assert int(client.hget(keys["data_cursor"], "consumed")) == PROMPTS
            assert client.hlen(keys["data_place"]) == client.llen(keys["data_returned"]) == 0
        # the job's user was refused nothing but CONFIG GET, which the server checks ask for first and, refused,
        # read from INFO instead (buffer/redis/conn.py)
        assert set(denials(admin, user)) <= {("command", "config|get")}, denials(admin, user)
        admin.acl_deluser(user)
        # the first learner evaluated the held-out prompts on the fleet, through Redis, before its first step
        assert re.search(r"evaluation of v0 on .* over 4 prompts", (tmp_path / "learner.log").read_text())
    print(f"exactly once ({backend}): {len(trained)} prompts trained over {len(timeline)} steps, resumed at "
          f"v{summary['start_version']} ({resumed_from['out']} prompts out then); held when killed "
          f"{({k: len(v) for k, v in held_when_killed.items()})}; "
          f"dealt {last['data/dealt']:.0f}, returned "
          f"{ {k: v for k, v in last.items() if k.startswith('data/returned/')} }")
