"""Buffer throughput and latency: each backend beside its raw transport, same payloads (it reports; it asserts
nothing).

For 4 KB and 64 KB groups, a producer process sends `--count` groups as fast as the path allows and this process
consumes them; latency is from the producer stamping the message to the consumer holding it. The backends run with
weights announced, as in a real job (a 0.5B model's: 291 tensors, 17 KB).
- zmq backend: ZmqBufferClient.send requests, as many in flight as a generator keeps by default
  (generator.max_inflight_groups) -> ZmqBufferServer (queue) -> take() (validation).
- raw zmq: PUSH/PULL of the same encoded bytes.
- redis backend: RedisBufferClient.send requests, as many in flight (batched into MULTIs of XADD + DELIVER) ->
  RedisBufferServer (XREADGROUP, validation) -> take(), ack.
- raw redis: pipelined XADD; XREADGROUP + XACK.
Target: each backend at >= 0.8 of its raw transport in groups/s. Needs redis-server on PATH (a private one is
started on a free port).

Each pair runs `--repeats` times, raw and backend alternating, and the table shows the median run of each side and
the median of the per-pair ratios: on a shared 2-core machine one pair can land anywhere from 0.5 to 1.8 (a
scheduling accident stalls a whole run; over 27 pairs the quartiles sit near 0.75-0.8 and 1.0-1.05), so a single pair
measures luck and 9 pairs still move the median by 0.2. Beside them, each side's CPU time per group (median over
the runs): the consumer process's while it consumes (server thread, I/O threads and the taking thread together)
and the producer's while it sends (its imports and start-up excluded). CPU per group moves less than groups/s with
the machine's load (a few tens of percent here, against 2x), so it shows what a backend costs over its raw
transport when the ratio is lost in noise.
The backends' producers run on the generator's event loop (`--loop`, uvloop by default, generator/event_loop.py).
`--compare-loops` adds, per path and size, pairs of the backend's producer on plain asyncio and on uvloop: the
ratio is uvloop's groups/s over asyncio's, and the producer's CPU per group is the cost of the loop itself.
Usage:
python -m asyncrl.bench.buffer [--count N] [--repeats R] [--paths all|zmq|redis] [--loop uvloop|asyncio]
                               [--compare-loops]
"""
import argparse
import json
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import tempfile
import time
import uuid

import numpy as np

from asyncrl.buffer.codec import decode_group, encode_group
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.generator.config import GeneratorConfig

VOCAB = 32000
IN_FLIGHT = GeneratorConfig().max_inflight_groups  # requests a generator keeps in flight by default (16)
STAMP = struct.Struct("<d")


def make_payload(size_bytes: int) -> Group:
    """A group of 4 samples whose encoding is about size_bytes (12 bytes per completion token)."""
    tokens = max(1, size_bytes // (12 * 4))
    rng = np.random.default_rng(0)
    samples = [Sample(completion_ids=rng.integers(0, VOCAB, tokens).astype(np.int32),
                      logprobs=-rng.random(tokens).astype(np.float32), versions=np.zeros(tokens, np.int32),
                      reward=1.0, finish_reason="stop") for _ in range(4)]
    return Group(group_id=uuid.uuid4().hex, prompt_id="p", generator_id="bench",
                 prompt_ids=np.arange(16, dtype=np.int32), samples=samples, sampling=Sampling(temperature=1.0),
                 created_at=0.0)


def published_weights():
    """The weights announcement a learner announces after publishing a Qwen2.5-0.5B-shaped model (291 tensors):
    the backends run with it set, as in a real job, where every generator must learn of each new one."""
    from asyncrl.weightsync.announcement import ShmRingPlace
    from asyncrl.weightsync.layout import announcement_for, plan_layout

    hidden, inter, kv = 896, 4864, 128
    layer = [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.q_proj.bias", (hidden,)),
             ("self_attn.k_proj.weight", (kv, hidden)), ("self_attn.k_proj.bias", (kv,)),
             ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.v_proj.bias", (kv,)),
             ("self_attn.o_proj.weight", (hidden, hidden)), ("mlp.gate_proj.weight", (inter, hidden)),
             ("mlp.up_proj.weight", (inter, hidden)), ("mlp.down_proj.weight", (hidden, inter)),
             ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    specs = [("model.embed_tokens.weight", "bfloat16", (151936, hidden))]
    specs += [(f"model.layers.{i}.{name}", "bfloat16", shape) for i in range(24) for name, shape in layer]
    specs += [("model.norm.weight", "bfloat16", (hidden,)), ("lm_head.weight", "bfloat16", (151936, hidden))]
    layout = plan_layout(specs, 64 << 20)
    return announcement_for(layout, 1, ["0" * 16] * len(layout.bucket_sizes), publisher="bench",
                            published_at=time.time(), shm=ShmRingPlace("/dev/shm/asyncrl-bench", "bench", 3))


def bench_run_info():
    """The run info the servers hand every generator that says hello (the benchmark's clients only read weights)."""
    from asyncrl.buffer.interface import RunInfo

    return RunInfo(model_path="", train_files=(), mlflow_run_id="", tracking_uri="", host="bench", job_dir="",
                   job="bench")


def stamped(group: Group) -> bytes:
    group.group_id = uuid.uuid4().hex
    group.created_at = time.time()
    return encode_group(group)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- producers (separate processes) ---------------------------------------------------------------------------
def produce_raw_zmq(port: int, size: int, count: int, report) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{port}")
    group = make_payload(size)
    started = time.process_time()
    for _ in range(count):
        sock.send(STAMP.pack(time.time()) + encode_group(group))
    sock.close(linger=-1)
    report.send(time.process_time() - started)


def produce_zmq_backend(port: int, size: int, count: int, loop: str, report) -> None:
    import asyncio

    from asyncrl.generator.event_loop import run as run_loop
    from asyncrl.buffer.zmq.client import ZmqBufferClient  # imported before the clock starts, as in every producer

    async def run():
        client = ZmqBufferClient(f"tcp://127.0.0.1:{port}", "bench", 30)
        left = [count]

        async def worker():  # a generator keeps several groups in flight (generator.max_inflight_groups)
            group = make_payload(size)
            while left[0] > 0:
                left[0] -= 1
                while True:
                    payload = stamped(group)
                    if (await client.send(group.group_id, payload)).accepted:
                        break
                    await asyncio.sleep(0.001)  # back-pressure: the queue is full

        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        client.close()

    started = time.process_time()
    run_loop(run(), loop)
    report.send(time.process_time() - started)


def produce_raw_redis(url: str, key: str, size: int, count: int, report) -> None:
    import redis

    client = redis.Redis.from_url(url)
    group = make_payload(size)
    started = time.process_time()
    pipe = client.pipeline(transaction=False)
    for index in range(count):
        pipe.xadd(key, {"g": STAMP.pack(time.time()) + encode_group(group)})
        if index % 32 == 31:
            pipe.execute()
    pipe.execute()
    report.send(time.process_time() - started)


def produce_redis_backend(url: str, job: str, size: int, count: int, loop: str, report) -> None:
    """The generator's real path: RedisBufferClient.send, IN_FLIGHT at once (it pipelines them)."""
    import asyncio

    from asyncrl.generator.event_loop import run as run_loop
    from asyncrl.buffer.redis.client import RedisBufferClient
    from asyncrl.buffer.redis.conn import RedisOptions, connect

    async def run():
        client = RedisBufferClient(connect(RedisOptions(url)), url, job, "bench", 1 << 20, 1 << 20, lease_s=60)
        left = [count]

        async def worker():
            group = make_payload(size)
            while left[0] > 0:
                left[0] -= 1
                payload = stamped(group)
                reply = await client.send(group.group_id, payload)
                assert reply.accepted, reply

        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        client.close()

    started = time.process_time()
    run_loop(run(), loop)
    report.send(time.process_time() - started)


# --- consumers (this process) ---------------------------------------------------------------------------------
def consume(take, count: int, stamp_of, timeout_s: float = 300) -> dict:
    latencies, nbytes = [], 0
    started, cpu_started, deadline = None, 0.0, time.monotonic() + timeout_s
    while len(latencies) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(latencies)}/{count} messages arrived")
        item = take()
        if item is None:
            continue
        now = time.time()
        if started is None:
            started, cpu_started = time.monotonic(), time.process_time()
        sent, size = stamp_of(item)
        latencies.append(now - sent)
        nbytes += size
    elapsed = max(time.monotonic() - started, 1e-9)
    return {"groups_per_s": (count - 1) / elapsed, "mb_per_s": nbytes / 2**20 / elapsed,
            "p50_ms": float(np.percentile(latencies, 50) * 1000), "p99_ms": float(np.percentile(latencies, 99) * 1000),
            "consumer_cpu_us": (time.process_time() - cpu_started) / (count - 1) * 1e6}


def start_producer(target, *args) -> tuple:
    """The producer process and the pipe on which it reports the CPU seconds it spent sending."""
    reader, writer = mp.Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(target=target, args=(*args, writer))
    proc.start()
    writer.close()
    return proc, reader


def finish(proc, reader, result: dict, count: int) -> dict:
    """Wait for the producer; add its CPU per group. CPU per group, unlike groups/s, barely moves with what else the
    machine runs, so it shows a backend's overhead when the throughput ratio is lost in noise."""
    proc.join()
    sent_cpu = reader.recv() if reader.poll(10) else float("nan")
    reader.close()
    return {**result, "producer_cpu_us": sent_cpu / count * 1e6}


def raw_stamp_of(message: bytes) -> tuple[float, int]:
    """A raw message's send time and size, after the same validation the backends do."""
    decode_group(message[STAMP.size:], vocab_size=VOCAB, max_version=0, max_message_bytes=1 << 24)
    return STAMP.unpack_from(message)[0], len(message) - STAMP.size


def backend_stamp_of(size: int):
    """A taken group's send time and encoded size: the bytes a raw message carries less its stamp, the same for
    every group of a run (encoded once here, not per group in the consumer's timed loop)."""
    nbytes = len(stamped(make_payload(size)))
    return lambda group: (group.created_at, nbytes)


def run_raw_zmq(size: int, count: int) -> dict:
    import zmq

    port = free_port()
    sock = zmq.Context().socket(zmq.PULL)
    sock.bind(f"tcp://127.0.0.1:{port}")
    proc, reader = start_producer(produce_raw_zmq, port, size, count)

    def take():
        if not sock.poll(1000):
            return None
        return sock.recv()

    try:
        return finish(proc, reader, consume(take, count, raw_stamp_of), count)
    finally:
        proc.join()
        sock.close(linger=0)


def run_zmq_backend(size: int, count: int, loop: str = "uvloop") -> dict:
    from asyncrl.buffer.staleness import Coordinator
    from asyncrl.buffer.zmq.server import ZmqBufferServer

    port = free_port()
    server = ZmqBufferServer("127.0.0.1", port, Coordinator(1 << 20, 1 << 20), vocab_size=VOCAB, config_hash="b",
                             max_message_bytes=1 << 24, queue_groups=256, run_info=bench_run_info())
    server.start()
    server.announce_weights(published_weights())
    proc, reader = start_producer(produce_zmq_backend, port, size, count, loop)
    try:
        return finish(proc, reader, consume(lambda: server.take(1.0), count, backend_stamp_of(size)), count)
    finally:
        proc.join()
        server.close()


def run_raw_redis(url: str, size: int, count: int) -> dict:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=30)
    key = f"bench:{uuid.uuid4().hex}"
    client.xgroup_create(key, "c", id="0", mkstream=True)
    proc, reader = start_producer(produce_raw_redis, url, key, size, count)
    ready = []

    def take():
        if not ready:
            reply = client.xreadgroup("c", "c1", {key: ">"}, count=64, block=1000)
            entries = reply[0][1] if reply else []
            if entries:
                client.xack(key, "c", *[entry_id for entry_id, _ in entries])
            ready.extend(fields[b"g"] for _, fields in entries)
        return ready.pop(0) if ready else None

    try:
        return finish(proc, reader, consume(take, count, raw_stamp_of), count)
    finally:
        proc.join()
        client.delete(key)


def run_redis_backend(url: str, size: int, count: int, loop: str = "uvloop") -> dict:
    from asyncrl.buffer.redis.conn import RedisOptions, connect
    from asyncrl.buffer.redis.coordinator import RedisCoordinator
    from asyncrl.buffer.redis.server import RedisBufferServer
    from asyncrl.buffer.redis.stream import reset_job

    client = connect(RedisOptions(url))
    job = f"bench{uuid.uuid4().hex[:8]}"
    coordinator = RedisCoordinator(client, job, 1 << 20, 1 << 20)
    coordinator.set_version(0, allow_backwards=True)  # as the learner does at start (make_learner_buffer)
    server = RedisBufferServer(client, url, job, coordinator, vocab_size=VOCAB,
                               config_hash="b", max_message_bytes=1 << 24, run_info=bench_run_info())
    server.start()
    server.announce_weights(published_weights())
    receipts = []
    proc, reader = start_producer(produce_redis_backend, url, job, size, count, loop)

    def take():
        group = server.take(1.0)
        receipts.extend(server.take_receipts())
        if len(receipts) >= 64 or (group is None and receipts):
            server.on_checkpoint(list(receipts))  # the learner acks in batches (per checkpoint)
            receipts.clear()
        return group

    try:
        return finish(proc, reader, consume(take, count, backend_stamp_of(size)), count)
    finally:
        proc.join()
        reset_job(client, job)


def repeated(repeats: int, raw, backend) -> dict:
    """`repeats` alternating raw/backend runs: the median run of each side (by groups/s), the median ratio of the
    pairs, and every pair's ratio."""
    runs = [(raw(), backend()) for _ in range(repeats)]
    ratios = sorted(b["groups_per_s"] / r["groups_per_s"] for r, b in runs)

    def median_run(side: int) -> dict:
        return sorted((pair[side] for pair in runs), key=lambda run: run["groups_per_s"])[len(runs) // 2]

    def median_cpu(side: int, key: str) -> float:
        return float(np.median([pair[side][key] for pair in runs]))

    return {"raw": median_run(0), "backend": median_run(1), "ratio": float(np.median(ratios)),
            "pair_ratios": [round(r, 3) for r in ratios],
            "cpu_us": {name: {"consumer": median_cpu(side, "consumer_cpu_us"),
                              "producer": median_cpu(side, "producer_cpu_us")}
                       for side, name in ((0, "raw"), (1, "backend"))}}


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    import redis

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
                             "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    return proc, f"redis://127.0.0.1:{port}/0"


def print_table(rows: dict, sides: tuple, ratio_label: str) -> None:
    """One line per path and side; the ratio (second side over first) on the second side's line."""
    print(f"{'path':<12} {'side':<8} {'groups/s':>10} {'MB/s':>8} {'p50 ms':>8} {'p99 ms':>8} {ratio_label:>7} "
          f"{'cpu us/group: consumer':>23} {'producer':>9}")
    for name, pair in rows.items():
        for side in sides:
            r = pair[side]
            ratio = f"{pair['ratio']:.2f}" if side == sides[1] else ""
            print(f"{name:<12} {side:<8} {r['groups_per_s']:>10.0f} {r['mb_per_s']:>8.1f} {r['p50_ms']:>8.2f} "
                  f"{r['p99_ms']:>8.2f} {ratio:>7} {pair['cpu_us'][side]['consumer']:>23.0f} "
                  f"{pair['cpu_us'][side]['producer']:>9.0f}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2000, help="groups per 4 KB run (64 KB runs send a quarter)")
    parser.add_argument("--paths", choices=("all", "zmq", "redis"), default="all",
                        help="which transports to run (zmq alone needs no redis-server)")
    parser.add_argument("--repeats", type=int, default=5, help="raw/backend pairs per path and size (median shown)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the event loop of the backends' producers (the generator's: generator.event_loop)")
    parser.add_argument("--compare-loops", action="store_true",
                        help="also run each backend's producer on asyncio against uvloop, in pairs")
    args = parser.parse_args(argv)
    if args.count < 2 or args.repeats < 1:
        parser.error("--count must be >= 2 and --repeats >= 1")
    rows, loops = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        redis_proc, url = start_redis(tmp) if args.paths != "zmq" else (None, None)
        try:
            for size, count in ((4096, args.count), (65536, max(10, args.count // 4))):
                label = f"{size // 1024}KB"
                backends = {}
                if args.paths != "redis":
                    backends["zmq"] = (lambda: run_raw_zmq(size, count),
                                       lambda loop: run_zmq_backend(size, count, loop))
                if args.paths != "zmq":
                    backends["redis"] = (lambda: run_raw_redis(url, size, count),
                                         lambda loop: run_redis_backend(url, size, count, loop))
                for path, (raw, backend) in backends.items():
                    rows[f"{path}/{label}"] = repeated(args.repeats, raw, lambda: backend(args.loop))
                    if args.compare_loops:
                        loops[f"{path}/{label}"] = repeated(args.repeats, lambda: backend("asyncio"),
                                                            lambda: backend("uvloop"))
        finally:
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait()
    print_table(rows, ("raw", "backend"), "vs raw")
    if loops:
        print_table({name: {"asyncio": pair["raw"], "uvloop": pair["backend"], "ratio": pair["ratio"],
                            "cpu_us": {"asyncio": pair["cpu_us"]["raw"], "uvloop": pair["cpu_us"]["backend"]}}
                     for name, pair in loops.items()}, ("asyncio", "uvloop"), "uv/aio")
    result = {"bench": "buffer", "count": args.count, "repeats": args.repeats, "loop": args.loop, "paths": rows,
              "loops": loops}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
