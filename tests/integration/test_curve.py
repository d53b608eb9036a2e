"""ZeroMQ CURVE on the real sockets (security/curve.py): the buffer and the weight catch-up server admit a generator
with a known key, and refuse, count and log a peer without CURVE, one with an unknown key, and one that trusts
another server key. Keys come from `asyncrl keys`. The whole job runs with keys in
tests/e2e/test_exactly_once.py (zmq)."""
import asyncio
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
import zmq

from asyncrl.buffer.interface import LearnerUnavailable
from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.client import ZmqBufferClient
from asyncrl.buffer.zmq.server import ZmqBufferServer
from asyncrl.security.curve import ClientKeys, KeysError, client_keys, make_keys, server_keys
from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.catchup import CatchupError, CatchupServer, fetch
from asyncrl.weightsync.layout import layout_of
from asyncrl.weightsync.publisher import WeightPublisher
from tests.conftest import free_port
from tests.messages import run_info


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    """The learner's keys and two clients', made by the CLI; `stranger` has keys the learner never admitted."""
    root = tmp_path_factory.mktemp("keys")
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "keys", str(root / "job"), "--clients",
                          "gen-a", "gen-b"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "wrote 6 files" in out.stdout
    assert oct(os.stat(root / "job" / "server.key_secret").st_mode & 0o777) == "0o600"
    make_keys(str(root / "other"), ["stranger"])
    return root


def buffer_server(keys):
    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(1, 2), vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=2, run_info=run_info(job="k"), keys=keys)
    server.start()
    return server


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def hello(endpoint, keys, name):
    client = ZmqBufferClient(endpoint, name, timeout_s=2, keys=keys)
    try:
        return asyncio.run(client.hello("h"))
    finally:
        client.close()


def test_the_buffer_admits_known_keys_and_refuses_counts_and_logs_the_rest(keys_dir, caplog):
    job = str(keys_dir / "job")
    server = buffer_server(server_keys(job))
    try:
        assert hello(server.endpoint, client_keys(job, "gen-a"), "gen-a").run_info == run_info(job="k")
        assert hello(server.endpoint, client_keys(job, "gen-b"), "gen-b").run_info == run_info(job="k")
        assert server.curve.refused == 0
        with caplog.at_level(logging.WARNING, logger="asyncrl.security.curve"):
            with pytest.raises(LearnerUnavailable, match="did not answer"):
                hello(server.endpoint, None, "plain")  # no CURVE at all
            assert wait_for(lambda: server.curve.refused >= 1)
            plain = server.curve.refused
            stranger = client_keys(str(keys_dir / "other"), "stranger")
            unknown = ClientKeys(stranger.public, stranger.secret, server_keys(job).public)
            with pytest.raises(LearnerUnavailable, match="CURVE keys"):  # a key the learner never admitted
                hello(server.endpoint, unknown, "stranger")
            assert wait_for(lambda: server.curve.by_kind["an unknown client key"] >= 1)
            refused = server.curve.refused
            with pytest.raises(LearnerUnavailable):  # trusts another server's key
                hello(server.endpoint, stranger, "impostor")
            assert wait_for(lambda: server.curve.refused > refused)
        assert server.curve.refused > plain
        assert "the buffer refused" in caplog.text
        assert server.metrics()["buffer/refused_connections"] == server.curve.refused
        assert set(server.joins) == {"gen-a", "gen-b"}  # nobody else got as far as a request
    finally:
        server.close()


def test_the_catch_up_server_serves_weights_only_to_known_keys(keys_dir, tmp_path):
    job = str(keys_dir / "job")
    catchup = CatchupServer("127.0.0.1", 0, keys=server_keys(job))
    publisher = WeightPublisher(str(tmp_path / "ring"), slots=2, bucket_bytes=4096, catchup=catchup)
    try:
        weights = [("w", torch.arange(12, dtype=torch.float32))]
        message = publisher.publish(iter(weights), 1, [("w", "float32", (12,))])
        dest = FlatBuckets(layout_of(message))
        got = fetch(catchup.address, 1, lambda m: dest, 5, keys=client_keys(job, "gen-a"))
        assert got.announcement == message and torch.equal(dict(dest.tensors())["w"], weights[0][1])
        with pytest.raises(CatchupError, match="did not answer"):
            fetch(catchup.address, 1, lambda m: dest, 1)
        stranger = client_keys(str(keys_dir / "other"), "stranger")
        unknown = ClientKeys(stranger.public, stranger.secret, server_keys(job).public)
        with pytest.raises(CatchupError, match="CURVE keys"):
            fetch(catchup.address, 1, lambda m: dest, 1, keys=unknown)
        assert wait_for(lambda: catchup.curve.refused >= 2) and catchup.served == 1
    finally:
        publisher.close()


def test_a_refused_key_never_hangs_the_catch_up_request(keys_dir, monkeypatch):
    """A refused handshake can drop the request socket's only pipe before the send; a send without a deadline then
    waited forever. A loaded machine is played by a 20 ms pause after connect: about half the tries then meet a
    socket with no pipe (measured), so the old code hung here. Each try must end within its timeout."""
    connect = zmq.Socket.connect

    def connect_then_stall(socket, address):
        connect(socket, address)
        time.sleep(0.02)

    monkeypatch.setattr(zmq.Socket, "connect", connect_then_stall)
    job = str(keys_dir / "job")
    catchup = CatchupServer("127.0.0.1", 0, keys=server_keys(job))
    stranger = client_keys(str(keys_dir / "other"), "stranger")
    unknown = ClientKeys(stranger.public, stranger.secret, server_keys(job).public)
    try:
        for _ in range(20):
            started = time.monotonic()
            with pytest.raises(CatchupError, match="did not answer"):
                fetch(catchup.address, 1, lambda m: None, 0.1, keys=unknown)
            assert time.monotonic() - started < 2.0
    finally:
        catchup.close()


def test_missing_or_wrong_key_files_are_named(keys_dir, tmp_path):
    assert server_keys("") is None and client_keys("", "generator") is None  # plain TCP
    with pytest.raises(KeysError, match="does not exist"):
        client_keys(str(keys_dir / "job"), "gen-z")
    (tmp_path / "clients").mkdir()
    (tmp_path / "server.key_secret").write_text("not a certificate\n")
    with pytest.raises(KeysError, match="server.key_secret"):
        server_keys(str(tmp_path))
    with pytest.raises(KeysError, match="no client public keys"):
        server_keys(_no_clients(tmp_path))


def _no_clients(tmp_path) -> str:
    """A keys dir with the server's pair and an empty clients/."""
    directory = tmp_path / "lonely"
    make_keys(str(directory), [])
    return str(directory)


def test_binding_beyond_loopback_without_keys_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.security.curve"):
        server = CatchupServer("0.0.0.0", 0)
        server.close()
        quiet = CatchupServer("127.0.0.1", 0)
        quiet.close()
    warnings = [r.getMessage() for r in caplog.records if "without CURVE keys" in r.getMessage()]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "asyncrl keys" in warnings[0]
