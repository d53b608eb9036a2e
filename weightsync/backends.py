"""Building the weight-sync ends from `weightsync.*`: the learner's publisher (ring, catch-up server, and with
backend=broadcast the chain-relay group, with backend=engine_push the push into vLLM engines) and the generator's
stage (which joins the group when the announcement names one)."""
import logging
import os
import time

import torch

from asyncrl.weightsync.announcement import BroadcastPlace
from asyncrl.weightsync.catchup import CatchupServer
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.shm_ring import remove_stale

log = logging.getLogger(__name__)


class BroadcastPlane:
    """The publisher's view of the broadcast group: one `send` per version, which never raises for a generator's
    failure (broadcast.sender.SendReport names it; the generator catches up), and a `describe` for the announcement."""

    def __init__(self, sender, timeout_s: float, advertise: str):
        from asyncrl.weightsync.broadcast.chain import bucket_device

        self.sender = sender
        self.device = bucket_device(sender.backend)
        """Where the buckets this group sends must be (the publisher keeps its copy there): the GPU for NCCL."""
        self.timeout_s = timeout_s
        self.address = f"{advertise}:{sender.address.rsplit(':', 1)[1]}" if advertise else sender.address
        self.last_report = None

    def describe(self) -> dict:
        """The announcement's `broadcast` field: WeightStage joins the group from there."""
        return {"broadcast": BroadcastPlace(self.address, self.sender.backend)}

    def send(self, version: int, buffers: list, ready=None, layout=None) -> None:
        report = self.sender.send(version, buffers, self.timeout_s, ready=ready)
        self.last_report = report
        if report.failed:
            log.warning("weight sync v%d: %d generators got it by broadcast; failed: %s (they catch up)", version,
                        len(report.delivered), report.failed)

    def close(self) -> None:
        self.sender.close()


class EnginePushPlane:
    """The publisher's view of the push into engines (engine_push/sender.py): once every bucket of a version is on
    the learner's GPU, push it to every registered vLLM engine; never raises for a generator's failure."""

    def __init__(self, sender, timeout_s: float, device=None):
        from asyncrl.weightsync.broadcast.chain import bucket_device

        self.sender = sender
        self.device = device if device is not None else bucket_device("nccl")
        self.timeout_s = timeout_s
        self.address = sender.address
        self.last_report = None

    def describe(self) -> dict:
        """The announcement's `engines` field: a generator registers its engine there."""
        return {"engines": self.address}

    def send(self, version: int, buffers: list, ready=None, layout=None) -> None:
        from asyncrl.weightsync.buckets import FlatBuckets

        deadline = time.monotonic() + self.timeout_s
        for k in range(len(buffers)):
            if ready is not None and not ready(k, deadline):
                raise RuntimeError(f"push of v{version}: bucket {k} was never completed by the publisher")
        report = self.sender.send(version, FlatBuckets(layout, buffers), max(deadline - time.monotonic(), 0.001))
        self.last_report = report
        if report.failed:
            log.warning("weight sync v%d: pushed into %d engines; failed: %s (they load it from staging)", version,
                        len(report.delivered), report.failed)

    def close(self) -> None:
        self.sender.close()


def make_publisher(ws, job: str, keys=None) -> WeightPublisher:
    removed = remove_stale(ws.shm_dir, f"asyncrl-{job}-", ".ring")
    if removed:
        log.info("weight sync: removed rings of learners that died without cleaning up: %s", removed)
    ring_path = os.path.join(ws.shm_dir, f"asyncrl-{job}-{os.getpid()}.ring")
    catchup = CatchupServer(ws.host, ws.catchup_port, advertise=ws.advertise,
                            delta_max_fraction=ws.catchup_delta_max_fraction, keys=keys)
    plane = None
    if ws.backend == "broadcast":
        from asyncrl.weightsync.broadcast.sender import BroadcastSender

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        sender = BroadcastSender(ws.host, ws.broadcast_port, backend=backend, store_timeout_s=ws.timeout_s)
        plane = BroadcastPlane(sender, ws.timeout_s, ws.advertise)
    elif ws.backend == "engine_push":
        from asyncrl.weightsync.engine_push.sender import EnginePushSender

        if not torch.cuda.is_available():
            raise RuntimeError("weightsync.backend=engine_push sends from the learner's GPU over NCCL, and this "
                               "learner has no CUDA device; use shm or broadcast on a CPU machine")
        if ws.engine_transport == "ipc" and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            raise RuntimeError("weightsync.engine_transport=ipc: vLLM's IPC trainer gathers handles over every rank "
                               "of the learner, and asyncrl publishes from rank 0 alone; use nccl with a "
                               "multi-rank learner")
        sender = EnginePushSender(ws.host, ws.broadcast_port, advertise=ws.advertise,
                              store_timeout_s=ws.timeout_s, transport=ws.engine_transport)
        plane = EnginePushPlane(sender, ws.timeout_s)
    return WeightPublisher(ring_path, ws.keep_versions, int(ws.bucket_mb * 2**20), plane=plane, catchup=catchup)
