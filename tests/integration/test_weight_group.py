"""The torch.distributed weight-sync data plane with real gloo groups: the learner (BroadcastSender) runs in the
test process, and each generator (BroadcastMember with its background receiver) is this module run as a script
in its own process. Each generator prints one JSON line per version it holds (with a CRC32 per bucket) and exits
when its stdin closes. Buckets are a few MB."""
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

from asyncrl.weightsync.broadcast.chain import PeerError
from asyncrl.weightsync.broadcast.protocol import NoAnnouncement
from asyncrl.weightsync.broadcast.sender import BroadcastSender
from asyncrl.weightsync.broadcast.member import BroadcastMember

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [1 << 20, 2 << 20, 1 << 20, 12_345]
HEARTBEAT_TIMEOUT_S = 1.0


def bucket_crcs(buckets: list[torch.Tensor]) -> list[int]:
    return [zlib.crc32(bucket.numpy()) for bucket in buckets]


def make_version(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator) for size in SIZES]


class Generator:
    """One generator process, stopped by PID; `events` collects its JSON lines as they arrive."""

    def __init__(self, address: str, member_id: str):
        self.member_id = member_id
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.test_weight_group", address, member_id],
                                     cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.events: list[dict] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.changed:
                self.events.append(json.loads(line))
                self.changed.notify_all()

    def wait_for(self, key: str, value, timeout_s: float = 30) -> dict:
        with self.changed:
            found = self.changed.wait_for(lambda: any(e.get(key) == value for e in self.events), timeout_s)
        assert found, f"{self.member_id}: no event {key}={value} in {timeout_s} s; got {self.events}"
        return next(e for e in self.events if e.get(key) == value)

    def versions(self) -> dict[int, list[int]]:
        with self.changed:
            return {e["version"]: e["crcs"] for e in self.events if "version" in e}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def host():
    host = BroadcastSender(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    yield host
    host.close()


@pytest.fixture
def start_generators(host):
    started = []

    def start(*member_ids):
        generators = [Generator(host.address, member_id) for member_id in member_ids]
        started.extend(generators)
        tickets = {g.member_id: g.wait_for("registered", g.member_id)["ticket"] for g in generators}
        return sorted(generators, key=lambda g: tickets[g.member_id])  # = chain order

    yield start
    for generator in started:
        generator.stop()


def send_and_check(host, version: int, expect: list[Generator], timeout_s: float = 10):
    buckets = make_version(version)
    report = host.send(version, buckets, timeout_s)
    assert report.ok and sorted(report.delivered) == sorted(g.member_id for g in expect), report
    for generator in expect:
        generator.wait_for("version", version)
        assert generator.versions()[version] == bucket_crcs(buckets), generator.member_id
    return report


@pytest.mark.slow
def test_three_members_receive_identical_bytes_for_two_versions(host, start_generators):
    generators = start_generators("g0", "g1", "g2")
    first = send_and_check(host, 1, generators)
    second = send_and_check(host, 2, generators)
    assert first.generation == second.generation == 1  # same members: the group is reused
    assert second.seconds < 2.0


@pytest.mark.slow
def test_member_joining_after_the_first_version_gets_the_second(host, start_generators):
    (early,) = start_generators("early")
    send_and_check(host, 1, [early])
    (late,) = start_generators("late")
    report = send_and_check(host, 2, [early, late])
    assert report.generation == 2
    assert 1 not in late.versions()


@pytest.mark.slow
def test_member_killed_mid_transfer_is_named_the_survivors_get_the_next_send_and_it_can_rejoin(host, start_generators):
    first, victim, last = start_generators("a", "b", "c")  # chain: learner -> first -> victim -> last
    send_and_check(host, 1, [first, victim, last])
    os.kill(victim.proc.pid, signal.SIGSTOP)  # stalls inside its receive of version 2 ...
    threading.Timer(0.5, os.kill, (victim.proc.pid, signal.SIGKILL)).start()  # ... and dies there
    start = time.monotonic()
    report = host.send(2, make_version(2), timeout_s=5.0)
    elapsed = time.monotonic() - start
    assert elapsed < 5.0, report
    assert report.dropped == [victim.member_id] and "(dead or stalled)" in report.failed[victim.member_id], report
    assert report.delivered == [first.member_id], report  # upstream of the dead member: got the version
    assert f"{victim.member_id!r} (rank 2" in report.failed[last.member_id], report  # downstream: missed it
    start = time.monotonic()
    report = send_and_check(host, 3, [first, last])  # the next generation repairs the chain
    assert time.monotonic() - start < 2.0 and report.generation == 2  # generation 1 broke at version 2
    assert 2 not in last.versions()
    (restarted,) = start_generators(victim.member_id)  # a restart registers again under the same id
    report = send_and_check(host, 4, [first, last, restarted])
    assert report.generation == 3


@pytest.mark.slow
def test_stalled_member_times_out_with_errors_that_name_it(host, start_generators):
    stalled, behind = start_generators("x", "y")
    send_and_check(host, 1, [stalled, behind])
    os.kill(stalled.proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    report = host.send(2, make_version(2), timeout_s=3.0)
    assert time.monotonic() - start < 3.5, report
    assert report.dropped == [stalled.member_id] and report.delivered == [], report
    assert f"{stalled.member_id!r} (rank 1" in report.failed[stalled.member_id], report
    assert "no acknowledgement" in report.failed[stalled.member_id], report
    why = report.failed[behind.member_id]
    assert "receive of bucket 0" in why and f"{stalled.member_id!r} (rank 1" in why, report
    os.kill(stalled.proc.pid, signal.SIGKILL)
    send_and_check(host, 3, [behind])


def test_receive_without_a_send_times_out_naming_the_learner(host):
    member = BroadcastMember.connect(host.address, "lonely", timeout_s=5)
    try:
        start = time.monotonic()
        with pytest.raises(NoAnnouncement, match=f"'lonely'.*learner at {host.address}"):
            member.receive(make_version(0), timeout_s=0.3)
        assert time.monotonic() - start < 1.5
    finally:
        member.close()


def test_connect_to_a_missing_learner_names_the_address():
    with pytest.raises(PeerError, match="'nobody'.*127.0.0.1:9"):
        BroadcastMember.connect("127.0.0.1:9", "nobody", timeout_s=0.5)


def test_a_store_bound_beyond_loopback_says_it_has_no_authentication(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.weightsync.broadcast.roster"):
        for bind in ("0.0.0.0", "127.0.0.1"):
            BroadcastSender(bind, 0).close()
    warnings = [r.getMessage() for r in caplog.records if "authentication" in r.getMessage()]
    assert len(warnings) == 1 and "binds 0.0.0.0" in warnings[0] and "backend=broadcast" in warnings[0]


def run_generator(address: str, member_id: str) -> None:
    """A generator's receiving side: print each version's CRCs as it lands; leave when stdin closes."""
    member = BroadcastMember.connect(address, member_id, timeout_s=20, heartbeat_s=0.2)

    def on_version(version: int):
        latest = member.take_latest()
        if latest is not None:
            print(json.dumps({"version": latest[0], "crcs": bucket_crcs(latest[1])}), flush=True)
            member.release(latest[1])

    member.start_receiving(lambda: [torch.zeros(size, dtype=torch.uint8) for size in SIZES], on_version)
    print(json.dumps({"registered": member_id, "ticket": member.info["ticket"]}), flush=True)
    sys.stdin.read()
    member.close()


if __name__ == "__main__":
    run_generator(sys.argv[1], sys.argv[2])
