"""ZeroMQ CURVE for the buffer and the weight catch-up server: keys from files, only known clients admitted,
refusals counted and logged.

Keys are ZeroMQ's own certificate files, written and read by pyzmq's `zmq.auth` (create_certificates,
load_certificate), and clients are checked by its ZAP handler (`zmq.auth.thread.ThreadAuthenticator`) against the
public keys in a directory. A refused handshake (a peer without CURVE, an unknown key, a wrong server key) is seen
on the server socket's monitor and counted in `refused`, with a warning for the first and then every 100th.

Layout of a keys directory (`asyncrl keys DIR --clients a b`):
    DIR/server.key, DIR/server.key_secret      the learner's pair (generators need server.key only)
    DIR/clients/a.key, DIR/clients/a.key_secret  one pair per client (the learner needs the .key files only)
"""
import glob
import ipaddress
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)
REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
LOG_EVERY = 100


class KeysError(RuntimeError):
    """A keys directory lacks a file this process needs, or holds one that is not a CURVE certificate."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    clients_dir: str


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def _load(path: str, secret: bool) -> tuple:
    if not os.path.isfile(path):
        raise KeysError(f"CURVE key file {path} does not exist (make keys with `asyncrl keys DIR`)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as err:
        raise KeysError(f"{path} is not a ZeroMQ CURVE certificate: {err}") from None
    if secret and not secret_key:
        raise KeysError(f"{path} holds no secret key (the .key_secret file is needed here)")
    return public, secret_key


def server_keys(keys_dir: str) -> ServerKeys | None:
    """The learner's keys, or None when `keys_dir` is "" (plain TCP)."""
    if not keys_dir:
        return None
    public, secret = _load(os.path.join(keys_dir, "server.key_secret"), secret=True)
    clients = os.path.join(keys_dir, "clients")
    if not glob.glob(os.path.join(clients, "*.key")):
        raise KeysError(f"{clients} holds no client public keys (*.key): no generator could connect")
    return ServerKeys(public, secret, clients)


def client_keys(keys_dir: str, name: str) -> ClientKeys | None:
    """A generator's keys, or None when `keys_dir` is "" (plain TCP)."""
    if not keys_dir:
        return None
    server_public, _ = _load(os.path.join(keys_dir, "server.key"), secret=False)
    public, secret = _load(os.path.join(keys_dir, "clients", f"{name}.key_secret"), secret=True)
    return ClientKeys(public, secret, server_public)


def make_keys(keys_dir: str, clients: list[str]) -> list[str]:
    """Write the server's pair and one pair per client (existing files are kept: rotating keys is deleting
    them first). Returns the files written."""
    os.makedirs(os.path.join(keys_dir, "clients"), exist_ok=True)
    written = []
    for directory, name in [(keys_dir, "server")] + [(os.path.join(keys_dir, "clients"), c) for c in clients]:
        if os.path.exists(os.path.join(directory, f"{name}.key_secret")):
            continue
        public, secret = zmq.auth.create_certificates(directory, name)
        os.chmod(secret, 0o600)
        written += [public, secret]
    return written


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only the learner's resolver knows; say so rather than guess
        return False


def warn_if_open(host: str, keys, what: str) -> bool:
    """Log a warning when `what` binds beyond loopback without keys; True when it did."""
    if keys is not None or is_loopback(host):
        return False
    log.warning("%s binds %s without CURVE keys: anyone who can reach it can %s. Make keys with `asyncrl keys DIR` "
                "and set security.keys_dir on the learner and every generator.", what, host,
                "send groups and read the run's prompts" if "buffer" in what else "download the weights")
    return True


def secure_client(socket: zmq.Socket, keys: ClientKeys | None) -> None:
    """Before connect: encrypt and present this client's key (nothing when keys is None)."""
    if keys is None:
        return
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.server_public


class CurveGuard:
    """One server socket's CURVE: `before_bind` makes it a CURVE server admitting only the known clients (a ZAP
    thread on its context), `after_bind` starts counting refused handshakes. With keys None it does nothing."""

    def __init__(self, context: zmq.Context, keys: ServerKeys | None, what: str):
        self.keys, self.what = keys, what
        self.refused = 0
        self.by_kind: Counter = Counter()  # refusals by what was wrong (the text the warning uses)
        self._auth = None
        self._monitor = None
        self._thread = None
        self._stop = threading.Event()
        if keys is not None:
            self._auth = ThreadAuthenticator(context, log=logging.getLogger(f"{__name__}.zap"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=keys.clients_dir)

    def before_bind(self, socket: zmq.Socket) -> None:
        if self.keys is None:
            return
        socket.curve_secretkey = self.keys.secret
        socket.curve_publickey = self.keys.public
        socket.curve_server = True

    def after_bind(self, socket: zmq.Socket) -> None:
        if self.keys is None:
            return
        self._monitor = socket.get_monitor_socket(REFUSALS)
        self._thread = threading.Thread(target=self._watch, name="asyncrl-curve-monitor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not self._monitor.poll(200):
                continue
            try:
                event = recv_monitor_message(self._monitor)
            except zmq.ZMQError:
                return
            kind = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "an unknown client key",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a peer without CURVE or with another server key"}.get(
                event["event"], "a failed handshake")
            self.by_kind[kind] += 1
            self.refused += 1
            if self.refused == 1 or self.refused % LOG_EVERY == 0:
                log.warning("%s refused %s (%d refusals so far)", self.what, kind, self.refused)

    def close(self, socket: zmq.Socket | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._monitor is not None:
            if socket is not None:
                try:
                    socket.disable_monitor()
                except zmq.ZMQError:  # the socket is closing already, and its monitor with it
                    pass
            self._monitor.close(linger=0)
            self._monitor = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
