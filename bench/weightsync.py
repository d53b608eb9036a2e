"""Weight sync on CPU, end to end through the service (it reports; it does not assert).

The weights are a small Qwen2 (asyncrl.learner.model.build_qwen2) sized so its published fp32 state dict is about
`--mb` MiB; its files are saved to a temp dir for the hf engine (no model hub access). The learner is this process;
each generator is its own spawned process on this host.
1. `publish`: seconds of one full `WeightPublisher.publish` (named fp32 tensors -> ring slot, checksums, chain send,
   the receiver's ack) with backend=broadcast to one generator process whose `WeightStage` joined the group, beside
   a raw gloo `broadcast` of one preallocated flat buffer of the same bytes from this process to one spawned
   process. ratio = raw_s / publish_s (target >= 0.9). backend=shm (ring copy + checksums, no network) is shown
   for context, and so is the unbucketed alternative: one async gloo broadcast per tensor, all posted at once
   (`buckets_vs_per_tensor` > 1: the bucketed publish is faster than raw per-tensor sends).
2. `fanout`: the broadcast publish to 1, 2 and 4 generator processes; x1 = seconds / seconds with one (target
   <= 1.5). On one small host every hop of the chain copies through loopback on the same cores, so the CPU count
   bounds this (bench/weightsync_fanout.py measures the raw chain and plain broadcast).
3. `stall`: a generator process with the `hf` engine, per update: transfer = `stage.stage(message)` (bytes into
   local staging, checksummed; the engine keeps sampling meanwhile) and stall = `engine.load_weights(...)` (the
   engine holds its lock, so it cannot sample). It uses the shm path: the learner's ring is on this host.
4. `cast`: the same fp32 weights published as bfloat16 (weightsync.dtype=bfloat16, the usual engine dtype), shm
   backend: cast by the ring copy itself (what the learner does) beside a `.to(bfloat16)` per tensor before the
   copy (what it did before), alternating in this process. speedup = to_then_copy_s / cast_in_copy_s.

Every figure is the median of `--versions` versions after a warm-up of `keep_versions` versions (one per ring
slot): a slot's first write pays its page faults, which a running job paid long ago; the broadcast warm-up also
covers the generator's join and the group's rendezvous. Generators stage every version before the next publish, so
nothing overlaps a timed publish. The default, 512 MiB, runs in about 2 minutes on 2 cores.

`--torch-threads` sets the learner's intra-op threads, as `learner.torch_threads` does. On the 2-core dev machine,
with torch's default of 2 OpenMP threads, a multi-threaded `copy_` often takes about 8 ms whatever its size (the
OpenMP spin-wait; OMP_WAIT_POLICY=PASSIVE or 1 thread avoids it). It comes and goes: the shm publish of 512 MiB
(231 tensors) took 1.18 s in one run and 0.19 s in the next, so compare runs with care.

Usage: python -m asyncrl.bench.weightsync [--mb 512] [--versions 5] [--bucket-mb 64] [--torch-threads 0]
"""
import argparse
import asyncio
import json
import os
import queue
import shutil
import statistics
import tempfile
import time

WARMUP_VERSIONS = 3
"""Versions published before timing: one per ring slot (WeightSyncConfig.keep_versions, set to the same)."""
REPLY_TIMEOUT_S = 600.0
PUBLISH_TARGET, FANOUT_TARGET = 0.9, 1.5
CPU_NOTE = ("on a 2-core host the CPUs bound the fan-out: every hop copies through loopback on the same cores "
            "(a previous raw measurement, 4 vs 1 receivers: chain 2.72x, plain broadcast 3.97x)")


# --- the model -----------------------------------------------------------------------------------------------

def qwen2_shape(mb: float) -> tuple[int, int, int]:
    """(vocab, hidden, layers) whose fp32 state dict (tied embedding published twice, as the learner does) holds
    about `mb` MiB: about 60% in decoder layers (16 hidden^2 parameters each), the rest in the embedding."""
    hidden = 128 if mb < 64 else 512 if mb < 1024 else 1024
    layer_bytes = 16 * hidden * hidden * 4
    layers = max(1, round(0.6 * mb * 2**20 / layer_bytes))
    vocab = max(256, int((mb * 2**20 - layers * layer_bytes) / (2 * hidden * 4)))
    return vocab, hidden, layers


def build_model_dir(mb: float, directory: str) -> list:
    """Save the model to `directory` (for the hf engine); return its state dict as (name, fp32 tensor)."""
    from asyncrl.learner.model import build_qwen2

    vocab, hidden, layers = qwen2_shape(mb)
    model = build_qwen2(vocab, hidden, layers, eos_token_id=1, pad_token_id=0, seed=0)
    model.save_pretrained(directory)
    return [(name, tensor.detach().float().contiguous()) for name, tensor in model.state_dict().items()]


def specs_of(named: list) -> list:
    return [(name, "float32", tuple(tensor.shape)) for name, tensor in named]


def next_version(named: list, version: int) -> list:
    """Change one weight so every version has its own bytes (and checksums); outside any timed region."""
    named[0][1].view(-1)[0] = float(version)
    return named


# --- generator processes (spawned) ---------------------------------------------------------------------------

def run_stage_generator(directory: str, name: str, inbox, outbox) -> None:
    """A generator's weight path without an engine: stage each announced version (joining the broadcast group
    when a message names one), then report which path delivered it."""
    from asyncrl.weightsync.receiver import WeightStage

    stage = WeightStage(directory, name, catchup_timeout_s=60)
    try:
        while (message := inbox.get()) is not None:
            before = dict(stage.paths_used)
            staged = stage.stage(message)
            stage.end_load(staged, ok=True)
            path = next(p for p, count in stage.paths_used.items() if count > before[p])
            outbox.put({"name": name, "version": staged.version, "path": path})
    finally:
        stage.close()


def run_engine_generator(directory: str, model_dir: str, inbox, outbox) -> None:
    """A generator with the hf engine: per version, the transfer (stage) and the stall (load_weights) in seconds,
    done as generator/weights.py does (staging in a worker thread, the load under the engine's lock)."""
    from asyncrl.generator.engines.base import EngineOptions
    from asyncrl.generator.engines.hf_engine import HfEngine
    from asyncrl.weightsync.receiver import WeightStage

    async def serve() -> None:
        engine = HfEngine(EngineOptions(model_dir, "float32", max_model_len=128, kv_cache_gib=0.0, seed=0))
        await engine.start()
        stage = WeightStage(directory, "bench-engine", catchup_timeout_s=60)
        outbox.put({"ready": True})
        try:
            while (message := await asyncio.to_thread(inbox.get)) is not None:
                started = time.perf_counter()
                staged = await asyncio.to_thread(stage.stage, message)
                staged_at = time.perf_counter()
                await engine.load_weights(staged, stage.good)
                loaded_at = time.perf_counter()
                stage.end_load(staged, ok=True)
                outbox.put({"version": engine.version, "transfer_s": staged_at - started,
                            "stall_s": loaded_at - staged_at, "paths": dict(stage.paths_used)})
        finally:
            stage.close()
            await engine.close()

    asyncio.run(serve())


def run_raw_receiver(address: str, nbytes: int, rounds: int, sizes: list | None = None) -> None:
    """Rank 1 of the raw baseline: receive `rounds` broadcasts into one preallocated buffer (or, with `sizes`,
    one preallocated tensor per model tensor, each its own async broadcast)."""
    import datetime

    import torch
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=REPLY_TIMEOUT_S)
    store = dist.TCPStore(host, int(port), None, False, timeout, wait_for_workers=False)
    group = dist.ProcessGroupGloo(store, 1, 2, timeout)
    tensors = [torch.empty(size, dtype=torch.uint8) for size in (sizes or [nbytes])]
    for _ in range(rounds):
        group.barrier().wait()
        for work in [group.broadcast(tensor, 0) for tensor in tensors]:
            work.wait()
        group.barrier().wait()


def wait_reply(outbox, procs: list, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
    """The next reply of a generator, or an error naming a generator process that died meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return outbox.get(timeout=1.0)
        except queue.Empty:
            dead = [f"pid {p.pid} (exit code {p.exitcode})" for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"generator process {', '.join(dead)} died; see its stderr above")
    raise TimeoutError(f"no generator replied within {timeout_s} s")


def stop_processes(procs: list, inboxes: list = ()) -> None:
    """Ask each generator to stop (None in its inbox), then wait; one that does not stop in time is killed."""
    for inbox in inboxes:
        inbox.put(None)
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()


# --- the learner side ----------------------------------------------------------------------------------------

def time_raw_broadcast(nbytes: int, versions: int, sizes: list | None = None) -> list[float]:
    """Seconds of a gloo broadcast of one preallocated flat buffer (barrier, broadcast, barrier, as in
    bench/weightsync_fanout.py) from this process to one spawned one, after the warm-up. Not that file's
    `time_broadcast`: it keeps the best of its repeats, with rank 0 in a child process; here the median, from the
    process that publishes. With `sizes` (the model's tensor sizes in bytes): one async broadcast per tensor, all
    posted at once, the unbucketed alternative docs/platform.md measured."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    timeout = datetime.timedelta(seconds=REPLY_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    rounds = WARMUP_VERSIONS + versions
    proc = mp.get_context("spawn").Process(target=run_raw_receiver,
                                           args=(f"127.0.0.1:{store.port}", nbytes, rounds, sizes))
    proc.start()
    try:
        group = dist.ProcessGroupGloo(store, 0, 2, timeout)
        tensors = [torch.full((size,), 7, dtype=torch.uint8) for size in (sizes or [nbytes])]
        seconds = []
        for _ in range(rounds):
            group.barrier().wait()
            started = time.perf_counter()
            for work in [group.broadcast(tensor, 0) for tensor in tensors]:
                work.wait()
            group.barrier().wait()
            seconds.append(time.perf_counter() - started)
        return seconds[WARMUP_VERSIONS:]
    finally:
        stop_processes([proc])


def time_publish(named: list, backend: str, receivers: int, versions: int, directory: str,
                 bucket_mb: float) -> dict:
    """Seconds of `WeightPublisher.publish` per timed version with `receivers` generator processes staging every
    version; each broadcast version must reach all of them through the group."""
    import torch.multiprocessing as mp

    from asyncrl.weightsync.backends import make_publisher
    from asyncrl.weightsync.config import WeightSyncConfig

    ws = WeightSyncConfig(backend=backend, shm_dir=directory, keep_versions=WARMUP_VERSIONS, bucket_mb=bucket_mb,
                          timeout_s=REPLY_TIMEOUT_S)
    publisher = make_publisher(ws, f"bench-{backend}-{receivers}")
    context = mp.get_context("spawn")
    inboxes, outbox = [context.Queue() for _ in range(receivers)], context.Queue()
    procs = [context.Process(target=run_stage_generator, args=(directory, f"gen{i}", inbox, outbox))
             for i, inbox in enumerate(inboxes)]
    seconds, send_wait, paths = [], [], {}
    try:
        for proc in procs:
            proc.start()
        for version in range(1, WARMUP_VERSIONS + versions + 1):
            message, elapsed = publish_once(publisher, named, version, receivers if version > 1 else None)
            for inbox in inboxes:
                inbox.put(message)
            replies = [wait_reply(outbox, procs) for _ in procs]
            if version == 1 and backend == "broadcast":
                wait_for_members(publisher, receivers)  # v1 made them join; v2 forms the group
            if version > WARMUP_VERSIONS:
                seconds.append(elapsed)
                send_wait.append(publisher.timings["send_wait_s"])
                for reply in replies:
                    paths[reply["path"]] = paths.get(reply["path"], 0) + 1
        return {"seconds": seconds, "median_s": statistics.median(seconds),
                "median_send_wait_s": statistics.median(send_wait), "staged_by": paths}
    finally:
        stop_processes(procs, inboxes)
        publisher.close()


def publish_once(publisher, named: list, version: int, receivers: int | None) -> tuple[dict, float]:
    """(announcement, seconds) of one publish; with a group, every one of `receivers` must have it."""
    named, specs = next_version(named, version), specs_of(named)
    started = time.perf_counter()
    message = publisher.publish(iter(named), version, specs)
    elapsed = time.perf_counter() - started
    report = getattr(publisher.plane, "last_report", None)
    if report is not None and receivers is not None and (report.failed or len(report.delivered) != receivers):
        raise RuntimeError(f"v{version} reached {report.delivered} of {receivers} generators: {report}")
    return message, elapsed


def wait_for_members(publisher, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while int(publisher.plane.sender.store.add("ws/tickets", 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} generators did not join the broadcast group within {timeout_s} s")
        time.sleep(0.01)


def time_cast(named: list, versions: int, directory: str, bucket_mb: float) -> dict:
    """Seconds of an shm publish of fp32 `named` as bfloat16: cast in the ring copy vs cast first, alternating."""
    import torch

    from asyncrl.weightsync.publisher import WeightPublisher

    specs = [(name, "bfloat16", tuple(tensor.shape)) for name, tensor in named]
    publisher = WeightPublisher(os.path.join(directory, "bench-cast"), WARMUP_VERSIONS, int(bucket_mb * 2**20))
    seconds = {"cast_in_copy": [], "to_then_copy": []}
    try:
        for version in range(1, WARMUP_VERSIONS + versions + 1):
            for mode, times in seconds.items():
                tensors = iter(next_version(named, version)) if mode == "cast_in_copy" else (
                    (name, tensor.to(torch.bfloat16)) for name, tensor in next_version(named, version))
                started = time.perf_counter()
                publisher.publish(tensors, version, specs)
                if version > WARMUP_VERSIONS:
                    times.append(time.perf_counter() - started)
    finally:
        publisher.close()
    return {mode: statistics.median(times) for mode, times in seconds.items()}


def time_stall(named: list, model_dir: str, versions: int, directory: str, bucket_mb: float) -> dict:
    """Per timed version, transfer and stall seconds of an hf-engine generator process; shm backend."""
    import torch.multiprocessing as mp

    from asyncrl.weightsync.backends import make_publisher
    from asyncrl.weightsync.config import WeightSyncConfig

    ws = WeightSyncConfig(backend="shm", shm_dir=directory, keep_versions=WARMUP_VERSIONS, bucket_mb=bucket_mb)
    publisher = make_publisher(ws, "bench-stall")
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    proc = context.Process(target=run_engine_generator, args=(directory, model_dir, inbox, outbox))
    replies = []
    try:
        proc.start()
        wait_reply(outbox, [proc])  # the engine loaded its model
        for version in range(1, WARMUP_VERSIONS + versions + 1):
            inbox.put(publish_once(publisher, named, version, None)[0])
            reply = wait_reply(outbox, [proc])
            if reply["version"] != version:
                raise RuntimeError(f"the engine runs v{reply['version']} after loading v{version}")
            if version > WARMUP_VERSIONS:
                replies.append(reply)
    finally:
        stop_processes([proc], [inbox])
        publisher.close()
    transfer = statistics.median(r["transfer_s"] for r in replies)
    stall = statistics.median(r["stall_s"] for r in replies)
    return {"path": "shm", "transfer_s": [r["transfer_s"] for r in replies],
            "stall_s": [r["stall_s"] for r in replies], "median_transfer_s": transfer, "median_stall_s": stall,
            "stall_over_transfer": stall / transfer, "paths": replies[-1]["paths"]}


# --- report --------------------------------------------------------------------------------------------------

def print_publish(nbytes: int, raw: list, per_tensor: list, broadcast: dict, shm: dict) -> dict:
    raw_s = statistics.median(raw)
    rows = [("raw gloo broadcast (flat)", raw_s, None),
            ("raw per-tensor async bcast", statistics.median(per_tensor), None),
            ("publish, broadcast, 1 gen", broadcast["median_s"], broadcast["median_send_wait_s"]),
            ("publish, shm only", shm["median_s"], shm["median_send_wait_s"])]
    print(f"\n1. full publish vs raw broadcast, {nbytes / 2**20:.0f} MiB, median of {len(raw)} "
          f"(target: raw_s / publish_s >= {PUBLISH_TARGET}); send wait = after the last copy into the ring")
    print(f"{'path':<28} {'seconds':>8} {'GB/s':>6} {'raw_s/s':>8} {'send wait s':>11}")
    for path, seconds, wait in rows:
        wait = "" if wait is None else f"{wait:.3f}"
        print(f"{path:<28} {seconds:>8.3f} {nbytes / 1e9 / seconds:>6.2f} {raw_s / seconds:>8.2f} {wait:>11}")
    print(f"generator staged the broadcast versions by: {broadcast['staged_by']}")
    return {"raw_s": raw_s, "publish_s": broadcast["median_s"], "shm_publish_s": shm["median_s"],
            "raw_gbps": nbytes / 1e9 / raw_s, "publish_gbps": nbytes / 1e9 / broadcast["median_s"],
            "shm_gbps": nbytes / 1e9 / shm["median_s"], "ratio": raw_s / broadcast["median_s"],
            "publish_send_wait_s": broadcast["median_send_wait_s"], "shm_send_wait_s": shm["median_send_wait_s"],
            "target": PUBLISH_TARGET, "staged_by": broadcast["staged_by"],
            "per_tensor_async_s": statistics.median(per_tensor),
            "buckets_vs_per_tensor": statistics.median(per_tensor) / broadcast["median_s"]}


def print_fanout(nbytes: int, by_count: dict) -> dict:
    base = by_count[1]["median_s"]
    print(f"\n2. broadcast publish to N generators (target: x1 <= {FANOUT_TARGET}); {os.cpu_count()} CPUs")
    print(f"{'generators':>10} {'seconds':>8} {'GB/s':>6} {'x1':>6}")
    for count, result in by_count.items():
        seconds = result["median_s"]
        print(f"{count:>10} {seconds:>8.3f} {nbytes / 1e9 / seconds:>6.2f} {seconds / base:>6.2f}")
    print(f"note: {CPU_NOTE}")
    return {str(count): {"seconds": r["median_s"], "x1": r["median_s"] / base, "staged_by": r["staged_by"]}
            for count, r in by_count.items()} | {"target": FANOUT_TARGET, "cpus": os.cpu_count(), "note": CPU_NOTE}


def print_stall(stall: dict) -> dict:
    print("\n3. hf-engine generator per update, shm path (learner's ring on this host): transfer = stage() "
          "(engine keeps sampling), stall = load_weights() (engine locked)")
    print(f"{'version':<8} {'transfer s':>10} {'stall s':>8} {'stall/transfer':>14}")
    for index, (transfer, held) in enumerate(zip(stall["transfer_s"], stall["stall_s"])):
        print(f"{index + 1 + WARMUP_VERSIONS:<8} {transfer:>10.3f} {held:>8.3f} {held / transfer:>14.2f}")
    print(f"{'median':<8} {stall['median_transfer_s']:>10.3f} {stall['median_stall_s']:>8.3f} "
          f"{stall['stall_over_transfer']:>14.2f}")
    return {key: stall[key] for key in ("path", "median_transfer_s", "median_stall_s", "stall_over_transfer")}


def print_cast(nbytes: int, cast: dict) -> dict:
    speedup = cast["to_then_copy"] / cast["cast_in_copy"]
    print(f"\n4. fp32 weights published as bfloat16 ({nbytes / 2**21:.0f} MiB published), shm publish, median")
    print(f"{'cast':<34} {'seconds':>8}")
    print(f"{'in the ring copy (the learner)':<34} {cast['cast_in_copy']:>8.3f}")
    print(f"{'.to(bfloat16) first, then copy':<34} {cast['to_then_copy']:>8.3f}")
    print(f"speedup {speedup:.2f}")
    return {"cast_in_copy_s": cast["cast_in_copy"], "to_then_copy_s": cast["to_then_copy"], "speedup": speedup}


def weightsync_bench(mb: float, versions: int, bucket_mb: float, receivers: list[int]) -> dict:
    import torch

    workdir, shm_dir = tempfile.mkdtemp(prefix="asyncrl-bench-ws-"), tempfile.mkdtemp(dir="/dev/shm")
    try:
        named = build_model_dir(mb, workdir)
        print(flush=True)
        nbytes = sum(t.numel() * 4 for _, t in named)
        vocab, hidden, layers = qwen2_shape(mb)
        print(f"Qwen2 vocab {vocab}, hidden {hidden}, {layers} layers: {len(named)} fp32 tensors, "
              f"{nbytes / 2**20:.0f} MiB; buckets of {bucket_mb:g} MiB; {os.cpu_count()} CPUs; learner torch "
              f"threads {torch.get_num_threads()}")
        raw = time_raw_broadcast(nbytes, versions)
        per_tensor = time_raw_broadcast(nbytes, versions, sizes=[t.numel() * 4 for _, t in named])
        shm = time_publish(named, "shm", 0, versions, shm_dir, bucket_mb)
        by_count = {count: time_publish(named, "broadcast", count, versions, shm_dir, bucket_mb)
                    for count in receivers}
        stall = time_stall(named, workdir, versions, shm_dir, bucket_mb)
        cast = time_cast(named, versions, shm_dir, bucket_mb)
        return {"bench": "weightsync", "mb": round(nbytes / 2**20, 1), "versions": versions, "bucket_mb": bucket_mb,
                "torch_threads": torch.get_num_threads(),
                "publish": print_publish(nbytes, raw, per_tensor, by_count[1], shm),
                "fanout": print_fanout(nbytes, by_count),
                "stall": print_stall(stall), "cast": print_cast(nbytes, cast)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def rounded(value):
    """Floats to 4 decimals, inside any dicts and lists (the JSON line stays readable)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=512, help="size of the published fp32 weights, in MiB")
    parser.add_argument("--versions", type=int, default=5, help="timed versions per figure (median is kept)")
    parser.add_argument("--bucket-mb", type=float, default=64, help="weightsync.bucket_mb, in MiB")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch intra-op threads of the learner (this process), as learner.torch_threads; 0 keeps "
                             "torch's default (generators keep theirs)")
    parser.add_argument("--receivers", default="1,2,4", help="fan-out generator counts; must start with 1")
    args = parser.parse_args()
    counts = [int(count) for count in args.receivers.split(",")]
    if counts[0] != 1 or args.versions < 1:
        parser.error("--receivers must start with 1 and --versions must be >= 1")
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    result = weightsync_bench(args.mb, args.versions, args.bucket_mb, counts)
    print(json.dumps(rounded(result)))


if __name__ == "__main__":
    main()
