"""Chain relay of preallocated weight buckets over one torch.distributed process group.

Rank 0 (the learner) sends bucket k to rank 1; rank r receives bucket k from r-1 and, without waiting for the rest,
forwards it to r+1 while it receives bucket k+1. With B buckets and N receivers the last byte lands after about
(B + N - 1) bucket times instead of the N x B of a broadcast from rank 0, whose root pushes every byte N times.
That holds when each hop has its own link and cores (one generator per host or GPU); on one small host every hop
competes for the same CPUs, and the chain is then only as fast as the total copying allows.

Why point-to-point in one group rather than pairwise 2-rank groups: on gloo both measured the same (256 MB, 4
receivers: 0.279 s vs 0.267 s), and one group per generation keeps one rendezvous and one object to abort.

Every wait has a deadline, and each failure raises PeerError naming the peer it involved.
"""
import datetime
import time

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
BACKEND_DEVICE_TYPE = {"gloo": "cpu", "nccl": "cuda"}
"""The only device each backend moves tensors from: NCCL refuses CPU tensors, gloo's point-to-point ops CUDA ones."""


def bucket_device(backend: str) -> torch.device:
    """Where the buckets that `backend` sends or receives must live: the current CUDA device for NCCL, the CPU for
    gloo."""
    kind = BACKEND_DEVICE_TYPE[backend]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"a {backend} weight group needs a CUDA device, and this process has none")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def check_placement(backend: str, buckets: list[torch.Tensor], what: str) -> None:
    """Raise ValueError, naming the bucket and both devices, unless every bucket is where `backend` moves tensors
    from: a CPU bucket handed to NCCL fails inside NCCL with a message that names neither."""
    want = BACKEND_DEVICE_TYPE[backend]
    for k, bucket in enumerate(buckets):
        if bucket.device.type != want:
            raise ValueError(f"{what}: bucket {k} is on {bucket.device}, but {backend} moves {want} tensors only")


class PeerError(RuntimeError):
    """A rendezvous, send or receive involving one named peer failed or ran past its deadline."""


def make_process_group(backend: str, store: dist.Store, rank: int, size: int, timeout_s: float):
    """One process group over `store` (a PrefixStore per generation), without a default group.

    gloo: CPU tensors. nccl: CUDA tensors of the current device; a dead peer can leave NCCL kernels hanging, so run
    generators with TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (the watchdog must not kill the process) and rely on the
    timed waits here plus `abort_process_group`.
    """
    timeout = datetime.timedelta(seconds=max(timeout_s, 0.001))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def group_backend(group) -> str:
    """"gloo" or "nccl": the backend of a group from make_process_group (or a test's stand-in with `.name()`)."""
    name = group.name().lower() if callable(getattr(group, "name", None)) else "gloo"
    return "nccl" if "nccl" in name else "gloo"


def abort_process_group(group) -> None:
    """Cancel whatever is still pending in `group` so a late peer can never write into a bucket we gave back."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - best effort: the group is being thrown away either way
        pass


def wait_work(work, deadline: float, peer: str, what: str) -> None:
    """Wait for one send/recv until `deadline` (time.monotonic); raise PeerError naming `peer` otherwise."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise PeerError(f"{what} with {peer}: timed out (deadline already passed)")
    try:
        work.wait(datetime.timedelta(seconds=remaining))
    except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise plain RuntimeErrors
        late = "timed out" if time.monotonic() >= deadline - 0.01 else "failed"
        raise PeerError(f"{what} with {peer}: {late} after waiting up to {remaining:.1f} s ({exc})") from exc


def send_chain(group, buckets: list[torch.Tensor], deadline: float, first_peer: str, ready=None) -> None:
    """Rank 0: post each bucket to rank 1 (tag = bucket index) as soon as `ready(k, deadline)` says it is complete
    (None: all are), then wait for all of them. The publisher is still gathering later buckets meanwhile."""
    what = f"send of {len(buckets)} buckets to the first chain member"
    check_placement(group_backend(group), buckets, what)
    works = []
    for k, bucket in enumerate(buckets):
        if ready is not None and not ready(k, deadline):
            raise PeerError(f"{what} {first_peer}: bucket {k} was never completed by the publisher (publish "
                            f"aborted, or slower than the timeout)")
        try:
            works.append(group.send([bucket], 1, k))
        except Exception as exc:  # noqa: BLE001
            raise PeerError(f"{what} {first_peer}: failed to start ({exc})") from exc
    for k, work in enumerate(works):
        wait_work(work, deadline, first_peer, f"send of bucket {k}/{len(buckets)}")


def relay_chain(group, rank: int, buckets: list[torch.Tensor], deadline: float,
                upstream: str, downstream: str | None) -> str | None:
    """Rank r >= 1: receive each bucket from r-1 in place and forward it to r+1 as soon as it is complete.

`downstream` is None on the last rank of the chain.
    Raises PeerError (naming `upstream`) unless every bucket arrived in full. A failure to forward does not stop
    the receiving, so this member still completes the version; it is returned as a message naming `downstream`
    (None when forwarding succeeded or there is no downstream).
    """
    check_placement(group_backend(group), buckets, f"receive from {upstream}")
    forwards, forward_error = [], None
    for k, bucket in enumerate(buckets):
        try:
            work = group.recv([bucket], rank - 1, k)
        except Exception as exc:  # noqa: BLE001
            raise PeerError(f"receive of bucket {k}/{len(buckets)} from {upstream}: failed to start ({exc})") from exc
        wait_work(work, deadline, upstream, f"receive of bucket {k}/{len(buckets)}")
        if downstream is not None and forward_error is None:
            try:
                forwards.append(group.send([bucket], rank + 1, k))
            except Exception as exc:  # noqa: BLE001
                forward_error = f"forward of bucket {k}/{len(buckets)} to {downstream}: failed to start ({exc})"
    for k, work in enumerate(forwards):
        if forward_error is not None:
            break
        try:
            wait_work(work, deadline, downstream, f"forward of bucket {k}/{len(buckets)}")
        except PeerError as exc:
            forward_error = str(exc)
    return forward_error
