"""Building the weight-sync ends from `weightsync.*`: the learner's publisher (ring, catch-up server, and with
backend=broadcast the chain-relay group) and the generator's stage (which joins the group when the control message
names one)."""
import logging
import os

import torch

from asyncrl.weightsync.catchup import CatchupServer
from asyncrl.weightsync.publisher import WeightPublisher
from asyncrl.weightsync.shm_ring import remove_stale

log = logging.getLogger(__name__)


class GroupSender:
    """The publisher's view of the broadcast group: one `send` per version, which never raises for a generator's
    failure (group.host.SendReport names it; the generator catches up), and a `describe` for the control message."""

    def __init__(self, host, timeout_s: float, advertise: str):
        from asyncrl.weightsync.group.chain import bucket_device

        self.host = host
        self.device = bucket_device(host.backend)
        """Where the buckets this group sends must be (the publisher keeps its copy there): the GPU for NCCL."""
        self.timeout_s = timeout_s
        self.address = f"{advertise}:{host.address.rsplit(':', 1)[1]}" if advertise else host.address
        self.last_report = None

    def describe(self) -> dict:
        return {"address": self.address, "backend": self.host.backend}

    def send(self, version: int, buffers: list, ready=None) -> None:
        report = self.host.send(version, buffers, self.timeout_s, ready=ready)
        self.last_report = report
        if report.failed:
            log.warning("weight sync v%d: %d generators got it by broadcast; failed: %s (they catch up)", version,
                        len(report.delivered), report.failed)

    def close(self) -> None:
        self.host.close()


def make_publisher(ws, job: str) -> WeightPublisher:
    removed = remove_stale(ws.shm_dir, f"asyncrl-{job}-", ".ring")
    if removed:
        log.info("weight sync: removed rings of learners that died without cleaning up: %s", removed)
    ring_path = os.path.join(ws.shm_dir, f"asyncrl-{job}-{os.getpid()}.ring")
    catchup = CatchupServer(ws.catchup_host, ws.catchup_port, advertise=ws.catchup_advertise)
    group = None
    if ws.backend == "broadcast":
        from asyncrl.weightsync.group.host import WeightGroupHost

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        host = WeightGroupHost(ws.catchup_host, ws.broadcast_port, backend=backend, store_timeout_s=ws.timeout_s)
        group = GroupSender(host, ws.timeout_s, ws.catchup_advertise)
    return WeightPublisher(ring_path, ws.keep_versions, int(ws.bucket_mb * 2**20), group=group, catchup=catchup)
