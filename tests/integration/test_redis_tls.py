"""The Redis buffer over TLS against a real redis-server with a TLS port that requires client certificates (mutual
TLS): certificates are made here by a throwaway CA. Groups go through the stream and the coordinator over rediss://,
and every TLS mistake a user can make is a RedisSetupError that names the option to fix."""
import datetime
import ipaddress
import os
import uuid

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from asyncrl.buffer.redis.conn import RedisOptions, RedisSetupError, check_server, connect
from asyncrl.buffer.redis.coordinator import RedisCoordinator
from asyncrl.buffer.redis.stream import GroupStream
from tests.conftest import RedisServer, free_port

pytestmark = pytest.mark.redis


def issue(directory: str, name: str, issuer=None, server: bool = False):
    """A key and certificate `name`.crt/.key in `directory`, signed by `issuer` (key, cert), or self-signed (a CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[1].subject if issuer else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1)))
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(
            "127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer[0] if issuer else key, hashes.SHA256())
    with open(os.path.join(directory, f"{name}.key"), "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    with open(os.path.join(directory, f"{name}.crt"), "wb") as out:
        out.write(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """(rediss:// URL, certificate directory): redis-server with a TLS port that requires client certificates."""
    directory = str(tmp_path_factory.mktemp("tls"))
    ca = issue(directory, "ca")
    issue(directory, "server", ca, server=True)
    issue(directory, "client", ca)
    tls_port = free_port()
    pem = {name: os.path.join(directory, name) for name in ("ca.crt", "server.crt", "server.key")}
    server = RedisServer(directory, extra=("--tls-port", str(tls_port), "--tls-cert-file", pem["server.crt"],
                                           "--tls-key-file", pem["server.key"], "--tls-ca-cert-file", pem["ca.crt"],
                                           "--tls-auth-clients", "yes")).start()
    yield f"rediss://127.0.0.1:{tls_port}/0", directory
    server.kill()


def options(url: str, directory: str, ca=True, client=True, **kwargs) -> RedisOptions:
    pem = lambda name: os.path.join(directory, name)  # noqa: E731
    return RedisOptions(url, connect_timeout_s=2, tls_ca_file=pem("ca.crt") if ca else "",
                        tls_cert_file=pem("client.crt") if client else "",
                        tls_key_file=pem("client.key") if client else "", **kwargs)


def test_groups_and_admission_go_over_mutual_tls(tls_redis):
    url, directory = tls_redis
    client = connect(options(url, directory))
    info = check_server(client, url)
    assert info["redis_version"]
    job = uuid.uuid4().hex[:8]
    stream = GroupStream(client, job)
    stream.ensure_group()
    coordinator = RedisCoordinator(client, job, lead=0, groups_per_step=2)
    coordinator.set_version(0, allow_backwards=True)
    granted, _ = coordinator.try_admit("gen", 3)
    assert len(granted) == 2  # (η + v + 1) · B = 2, over TLS as over TCP
    payload = os.urandom(70_000)  # larger than one TLS record
    entry_id = stream.produce("g1", payload, granted[0])
    entries = stream.read(10, 100)
    assert [(entry.entry_id, entry.payload) for entry in entries] == [(entry_id, payload)]
    assert stream.ack([entry_id]) == 1
    client.close()


@pytest.mark.parametrize("ca, client, says", [
    (True, False, "buffer.redis.tls_cert_file and buffer.redis.tls_key_file"),  # the server requires a client cert
    (False, True, "buffer.redis.tls_ca_file"),  # the server's certificate is not trusted
])
def test_a_tls_handshake_that_fails_names_the_option(tls_redis, ca, client, says):
    url, directory = tls_redis
    with pytest.raises(RedisSetupError, match=says) as err:
        check_server(connect(options(url, directory, ca=ca, client=client)), url)
    assert url in str(err.value)


def test_tls_options_that_cannot_work_are_refused_before_connecting(tls_redis, tmp_path):
    url, directory = tls_redis
    plain = url.replace("rediss://", "redis://")
    with pytest.raises(RedisSetupError, match="is not TLS; use rediss://"):
        connect(options(plain, directory))
    with pytest.raises(RedisSetupError, match="no such file"):
        connect(RedisOptions(url, tls_ca_file=str(tmp_path / "missing.crt")))
    with pytest.raises(RedisSetupError, match="go together"):
        connect(RedisOptions(url, tls_cert_file=os.path.join(directory, "client.crt")))


def test_plain_text_to_the_tls_port_says_to_use_rediss(tls_redis):
    url, _ = tls_redis
    plain = url.replace("rediss://", "redis://")
    with pytest.raises(RedisSetupError, match="use rediss://"):
        check_server(connect(RedisOptions(plain, connect_timeout_s=2)), plain)


def test_tls_to_a_plain_port_says_so(redis_server, tls_redis):
    _, directory = tls_redis
    url = redis_server.url.replace("redis://", "rediss://")
    with pytest.raises(RedisSetupError, match="speak TLS"):
        check_server(connect(options(url, directory, block_ms=100)), url)
