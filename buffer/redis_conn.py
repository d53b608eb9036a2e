"""Connecting to the job's Redis, and checking at startup that it can hold a durable buffer.

The URL carries the password or ACL user (`redis://user:secret@host:6379/0`) and `rediss://` selects TLS; the TLS
file options are explicit arguments. Blocking stream reads wait up to `block_ms`, so the client's socket timeout is
set above that: redis-py 8's default `socket_timeout=5` turns any longer `XREADGROUP BLOCK` into a TimeoutError.
"""
from dataclasses import dataclass
from urllib.parse import urlsplit

MIN_VERSION = (6, 2)  # XAUTOCLAIM, XADD MINID trimming


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
        raise RedisSetupError(f"buffer.redis_url {redacted(options.url)!r} must start with redis://, rediss:// "
                              f"(TLS) or unix://")
    kwargs = dict(socket_timeout=options.block_ms / 1000 + 10, socket_connect_timeout=options.connect_timeout_s,
                  health_check_interval=30, retry_on_timeout=False)
    if options.url.startswith("rediss://"):
        kwargs.update({key: value for key, value in (("ssl_ca_certs", options.tls_ca_file),
                                                     ("ssl_certfile", options.tls_cert_file),
                                                     ("ssl_keyfile", options.tls_key_file)) if value})
    return redis.Redis.from_url(options.url, **kwargs)


def check_server(client, url: str) -> dict:
    """Ping, version and eviction policy; returns the server's INFO. Every failure names what to change."""
    import redis

    where = redacted(url)
    try:
        client.ping()
    except redis.AuthenticationError as err:
        raise RedisSetupError(f"Redis at {where} refused the credentials ({err}); put user:password in "
                              f"buffer.redis_url") from None
    except redis.ConnectionError as err:
        raise RedisSetupError(f"cannot reach Redis at {where}: {err} (is redis-server running there?)") from None
    except redis.ResponseError as err:
        raise RedisSetupError(f"Redis at {where} answered PING with an error: {err} (NOAUTH: give a password in "
                              f"buffer.redis_url)") from None
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
