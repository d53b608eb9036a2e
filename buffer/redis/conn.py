"""Connecting to the job's Redis, and checking at startup that it can hold a durable buffer.

The URL carries the password or ACL user (`redis://user:secret@host:6379/0`) and `rediss://` selects TLS; the TLS
file options are explicit arguments. Blocking stream reads wait up to `block_ms`, so the client's socket timeout is
set above that: redis-py 8's default `socket_timeout=5` turns any longer `XREADGROUP BLOCK` into a TimeoutError.
"""
import logging
import os
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger(__name__)
MIN_VERSION = (6, 2)  # XAUTOCLAIM, XADD MINID trimming
APPENDFSYNC = ("always", "everysec", "no")
LOSS_WINDOW = {
    "always": "nothing: every write is on disk before Redis replies",
    "everysec": "nothing if only redis-server dies; up to about 1 s of writes (2 s worst case) if the machine "
                "crashes or loses power",
    "no": "nothing if only redis-server dies; up to the OS's flush interval (about 30 s on Linux) if the machine "
          "crashes or loses power",
}
"""What a crash loses under each AOF fsync policy. Redis writes the AOF to the OS before it replies, so a killed
redis-server loses nothing under any policy; the policy only decides what a machine crash takes with it."""


class RedisSetupError(RuntimeError):
    """The Redis server cannot be reached or is not configured to hold the buffer; the message says what to fix."""


@dataclass
class RedisOptions:
    url: str
    """redis://[user[:password]@]host:port/db, or rediss:// for TLS."""
    block_ms: int = 1000
    """Longest a blocking read waits, in ms; the socket timeout is set above it."""
    connect_timeout_s: float = 5.0
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""


def redacted(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


def connect(options: RedisOptions):
    """A redis-py client (bytes responses) whose socket timeout suits blocking reads."""
    import redis

    if urlsplit(options.url).scheme not in ("redis", "rediss", "unix"):
        raise RedisSetupError(f"buffer.redis.url {redacted(options.url)!r} must start with redis://, rediss:// "
                              f"(TLS) or unix://")
    tls = _tls_files(options)
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # redis-py 6+ silently resends any command 3 times on a connection error. asyncrl retries itself, per
    # operation it knows to be idempotent, and must see the outage to re-read what a lost reply delivered
    # (reconnect.py); so the client's own retries are off.
    kwargs = dict(socket_timeout=options.block_ms / 1000 + 10, socket_connect_timeout=options.connect_timeout_s,
                  health_check_interval=30, retry_on_timeout=False, retry=Retry(NoBackoff(), 0))
    kwargs.update(tls)
    return redis.Redis.from_url(options.url, **kwargs)


def _tls_files(options: RedisOptions) -> dict:
    """redis-py's ssl_* arguments, after checking the TLS options make sense together: each file exists, the client
    certificate and key come as a pair, and they are only given with a rediss:// URL (a redis:// URL would ignore
    them and talk plain text)."""
    given = {key: path for key, path in (("tls_ca_file", options.tls_ca_file),
                                         ("tls_cert_file", options.tls_cert_file),
                                         ("tls_key_file", options.tls_key_file)) if path}
    if given and not options.url.startswith("rediss://"):
        raise RedisSetupError(f"buffer.redis.{', buffer.redis.'.join(given)} set, but buffer.redis.url {redacted(options.url)!r} "
                              f"is not TLS; use rediss://")
    for key, path in given.items():
        if not os.path.isfile(path):
            raise RedisSetupError(f"buffer.redis.{key}={path!r}: no such file")
    if bool(options.tls_cert_file) != bool(options.tls_key_file):
        raise RedisSetupError("buffer.redis.tls_cert_file and buffer.redis.tls_key_file go together (the client "
                              "certificate for mutual TLS, and its key)")
    names = {"tls_ca_file": "ssl_ca_certs", "tls_cert_file": "ssl_certfile", "tls_key_file": "ssl_keyfile"}
    return {names[key]: path for key, path in given.items()}


def _unreachable_hint(url: str, err: Exception) -> str:
    """What to check when a connection fails: TLS failures look like network ones in redis-py's message."""
    text = str(err)
    if url.startswith("rediss://"):
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return ("the server's TLS certificate is not signed by a CA this machine trusts: give its CA in "
                    "buffer.redis.tls_ca_file")
        if "EOF" in text or "reset" in text or "CERTIFICATE_REQUIRED" in text:
            return ("the server closed the TLS connection; if it requires client certificates (tls-auth-clients), "
                    "give buffer.redis.tls_cert_file and buffer.redis.tls_key_file")
        if "WRONG_VERSION_NUMBER" in text or "record layer" in text:
            return "the server does not speak TLS on that port: use redis:// or its tls-port"
        return "is redis-server running there, with TLS on that port?"
    if "reset" in text:
        return "is redis-server running there? If that port speaks TLS, use rediss://"
    return "is redis-server running there?"


def check_server(client, url: str) -> dict:
    """Ping, version and eviction policy; returns the server's INFO. Every failure names what to change."""
    import redis

    where = redacted(url)
    try:
        client.ping()
    except redis.AuthenticationError as err:
        raise RedisSetupError(f"Redis at {where} refused the credentials ({err}); put user:password in "
                              f"buffer.redis.url") from None
    except redis.ConnectionError as err:
        raise RedisSetupError(f"cannot reach Redis at {where}: {err} ({_unreachable_hint(url, err)})") from None
    except redis.TimeoutError as err:  # e.g. a TLS hello to a plain-text port: that server waits for more bytes
        hint = "does that port speak TLS? Use redis:// for a plain one" if url.startswith("rediss://") else \
            "is the host reachable, and is redis-server listening there?"
        raise RedisSetupError(f"Redis at {where} did not answer: {err} ({hint})") from None
    except redis.ResponseError as err:
        raise RedisSetupError(f"Redis at {where} answered PING with an error: {err} (NOAUTH: give a password in "
                              f"buffer.redis.url)") from None
    info = client.info("server")
    version = tuple(int(part) for part in str(info.get("redis_version", "0.0")).split(".")[:2])
    if version < MIN_VERSION:
        raise RedisSetupError(f"Redis at {where} is {info.get('redis_version')}; asyncrl needs >= 6.2 (XAUTOCLAIM)")
    try:
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.ResponseError:  # CONFIG may be renamed or disabled on managed servers: read it from INFO
        policy = client.info("memory").get("maxmemory_policy")
    if isinstance(policy, bytes):
        policy = policy.decode()
    if policy != "noeviction":
        raise RedisSetupError(f"Redis at {where} has maxmemory-policy {policy!r}: it may evict the buffer's stream "
                              f"(one key) and lose every queued group. Set `maxmemory-policy noeviction`.")
    return info


def configure_durability(client, url: str, appendfsync: str) -> str:
    """Apply buffer.redis.appendfsync ("" leaves the server as configured) and describe the resulting loss window.

    Without AOF a Redis restart loses the stream, the consumer group and the coordinator's state; the learner
    recreates them and carries on, but every queued and unacked group is gone, so that is warned about loudly.
    """
    import redis

    where = redacted(url)
    if appendfsync:
        if appendfsync not in APPENDFSYNC:
            raise RedisSetupError(f"buffer.redis.appendfsync must be one of {APPENDFSYNC} or '', got {appendfsync!r}")
        try:
            client.config_set("appendonly", "yes")
            client.config_set("appendfsync", appendfsync)
        except redis.ResponseError as err:
            raise RedisSetupError(f"Redis at {where} refused CONFIG SET appendonly/appendfsync ({err}); set "
                                  f"`appendonly yes` and `appendfsync {appendfsync}` in its redis.conf, and leave "
                                  f"buffer.redis.appendfsync empty") from None
        # Turning AOF on starts a rewrite that writes the initial file; until it finishes nothing is durable (and
        # Redis refuses to shut down), so the claim below waits for it to be true.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = client.info("persistence")
            if not (int(state.get("aof_rewrite_in_progress", 0)) or int(state.get("aof_rewrite_scheduled", 0))):
                break
            time.sleep(0.05)
    persistence = client.info("persistence")
    if not int(persistence.get("aof_enabled", 0)):
        message = (f"Redis at {where} has AOF off: if redis-server restarts, every queued and unacked group is lost "
                   f"(set buffer.redis.appendfsync=everysec, or `appendonly yes` on the server)")
        log.warning(message)
        return message
    try:
        policy = client.config_get("appendfsync").get("appendfsync", "everysec")
    except redis.ResponseError:
        policy = "everysec"  # CONFIG disabled: Redis's default
    policy = policy.decode() if isinstance(policy, bytes) else policy
    message = f"Redis at {where}: AOF with appendfsync={policy}; a crash loses {LOSS_WINDOW.get(policy, 'unknown')}"
    log.info(message)
    return message
