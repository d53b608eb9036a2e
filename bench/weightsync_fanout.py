"""Cost of publishing one weight version to 1, 2 and 4 generators: the chain relay of weightsync/broadcast/protocol.py
beside a plain gloo `broadcast` of one flat buffer of the same bytes from rank 0 (it reports; it asserts nothing).

Each receiver is its own process on this host. Chain: the learner's `BroadcastSender.send` of `--mb` MB in
`--bucket-mb` buckets, timed in full (announcement, relay, every receiver's ack), with the group already formed.
Broadcast: barrier, `broadcast`, barrier, timed on rank 0. Each figure is the best of `--repeats` after a warm-up.
Target: 4 receivers cost at most 1.5x one receiver. On one host every hop of the chain competes for the same
cores (each byte is copied through loopback once per receiver), so the chain's advantage shows only when the
machine has about two free cores per receiver; across hosts each hop has its own link.

Usage: python -m asyncrl.bench.weightsync_fanout [--mb 256] [--bucket-mb 32] [--receivers 1,2,4] [--repeats 3]
"""
import argparse
import json
import os
import socket
import time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bucket_sizes(nbytes: int, bucket_bytes: int) -> list[int]:
    """Equal buckets of `bucket_bytes` and a smaller last one."""
    sizes = [bucket_bytes] * (nbytes // bucket_bytes)
    return sizes + [nbytes % bucket_bytes] if nbytes % bucket_bytes else sizes


def run_chain_member(address: str, member_id: str, sizes: list[int], versions: int) -> None:
    import torch

    from asyncrl.weightsync.broadcast.member import BroadcastMember

    torch.set_num_threads(1)
    member = BroadcastMember.connect(address, member_id, timeout_s=60)
    buckets = [torch.empty(size, dtype=torch.uint8) for size in sizes]
    for _ in range(versions):
        member.receive(buckets, timeout_s=120)
    member.close()


def time_chain(nbytes: int, bucket_bytes: int, receivers: int, repeats: int) -> float:
    """Best seconds of `BroadcastSender.send` to `receivers` member processes."""
    import torch
    import torch.multiprocessing as mp

    from asyncrl.weightsync.broadcast.sender import BroadcastSender

    sizes = bucket_sizes(nbytes, bucket_bytes)
    buckets = [torch.randint(0, 256, (size,), dtype=torch.uint8) for size in sizes]
    host = BroadcastSender()
    context = mp.get_context("spawn")
    procs = [context.Process(target=run_chain_member, args=(host.address, f"bench{i}", sizes, repeats + 1))
             for i in range(receivers)]
    try:
        for proc in procs:
            proc.start()
        # every member registered, not just ticketed: a ticket is taken before its registration is written, and a
        # send in between forms a generation without that member
        while len(host.roster.live(on_drop=lambda info, reason: None)) < receivers:
            time.sleep(0.01)
        seconds = []
        for version in range(repeats + 1):
            report = host.send(version, buckets, timeout_s=120)
            if not report.ok or len(report.delivered) != receivers:
                raise RuntimeError(f"chain send failed: {report}")
            seconds.append(report.seconds)
        return min(seconds[1:])
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        host.close()


def run_broadcast_rank(rank: int, size: int, port: int, nbytes: int, repeats: int, result) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout, wait_for_workers=False)
    group = dist.ProcessGroupGloo(store, rank, size, timeout)
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(repeats + 1):
        group.barrier().wait()
        start = time.perf_counter()
        group.broadcast(flat, 0).wait()
        group.barrier().wait()
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        result.put(min(seconds[1:]))


def time_broadcast(nbytes: int, receivers: int, repeats: int) -> float:
    """Best seconds of one gloo broadcast of `nbytes` from rank 0 to `receivers` processes."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    result, port = context.Queue(), free_port()
    procs = [context.Process(target=run_broadcast_rank, args=(rank, receivers + 1, port, nbytes, repeats, result))
             for rank in range(receivers + 1)]
    for proc in procs:
        proc.start()
    try:
        return result.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def weightsync_fanout(nbytes: int, receivers: list[int], bucket_bytes: int, repeats: int) -> dict:
    """Time both paths for each receiver count; print the table and return {path: {receivers: seconds}}."""
    results = {"chain": {}, "broadcast": {}}
    for count in receivers:
        results["chain"][count] = time_chain(nbytes, bucket_bytes, count, repeats)
        results["broadcast"][count] = time_broadcast(nbytes, count, repeats)
    gigabytes = nbytes / 1e9
    print(f"{nbytes / 2**20:.0f} MB, chain buckets of {bucket_bytes / 2**20:.0f} MB, {os.cpu_count()} CPUs")
    print(f"{'path':<10} {'receivers':>9} {'seconds':>8} {'GB/s':>6} {'x 1 recv':>8}")
    for path, by_count in results.items():
        base = by_count[receivers[0]]
        for count, seconds in by_count.items():
            print(f"{path:<10} {count:>9} {seconds:>8.3f} {gigabytes / seconds:>6.2f} {seconds / base:>8.2f}")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="bytes per version, in MiB")
    parser.add_argument("--bucket-mb", type=int, default=32, help="chain bucket size, in MiB")
    parser.add_argument("--receivers", default="1,2,4", help="comma-separated receiver counts; the first is the base")
    parser.add_argument("--repeats", type=int, default=3, help="timed sends per setting (best is kept)")
    args = parser.parse_args()
    counts = [int(count) for count in args.receivers.split(",")]
    results = weightsync_fanout(args.mb << 20, counts, args.bucket_mb << 20, args.repeats)
    print(json.dumps({"bench": "weightsync_fanout", "mb": args.mb, "bucket_mb": args.bucket_mb,
                      "cpus": os.cpu_count(), **{path: {str(k): round(v, 4) for k, v in by_count.items()}
                                                 for path, by_count in results.items()}}))


if __name__ == "__main__":
    main()
