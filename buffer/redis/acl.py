"""A least-privilege Redis user for a job: only the commands asyncrl sends, only the job's keys.

Every key of a job is `asyncrl:{<namespace>}:...` (stream.py::job_keys; `buffer.redis.namespace`, default the job
name), so the user's key pattern is that prefix and nothing else. The commands are those the learner and the
generators send, directly or from their Lua scripts (Redis checks a script's calls against the caller's ACL too):
streams (the group stream and its consumer group), hashes, lists, sorted sets and strings for the coordinator and
the dealer, scripts, and the read-only INFO and TIME. Not granted: CONFIG (the server check reads INFO instead and
`buffer.redis.appendfsync` must stay empty: set persistence in redis.conf), FLUSH*, KEYS, DEBUG, pub/sub, and any
key outside the prefix. `tests/integration/test_redis_acl.py` runs a job's Redis traffic as this user and checks
what it is refused.
"""

COMMANDS = (
    # connection and server (read-only)
    "ping", "info", "time", "hello", "client|setname", "client|id", "select",
    # scripts: register_script sends EVALSHA, and SCRIPT LOAD after NOSCRIPT
    "eval", "evalsha", "script|load", "script|exists",
    # the group stream, its consumer group and the dead letters
    "xadd", "xreadgroup", "xack", "xpending", "xautoclaim", "xclaim", "xrange", "xrevrange", "xdel", "xtrim", "xlen",
    "xgroup|create", "xinfo|groups", "xinfo|stream",
    # the coordinator, the dealer, metadata and marks
    "get", "set", "del", "unlink", "exists", "expire", "pexpire", "incr", "incrby", "scan",
    "hget", "hset", "hsetnx", "hdel", "hgetall", "hmget", "hincrby", "hlen",
    "lpop", "rpush", "lrange", "llen", "ltrim",
    "zadd", "zrem", "zrange", "zrangebyscore", "zremrangebyscore", "zscore", "zmscore", "zcard",
    "multi", "exec", "discard",
)


def key_pattern(namespace: str) -> str:
    return f"asyncrl:{{{namespace}}}:*"


def acl_rules(namespace: str, password: str) -> list:
    """The ACL SETUSER rules, in order: enabled, the password, only the job's keys, no channels, no commands but
    COMMANDS."""
    if not namespace or any(char in namespace for char in "*?[]\\ "):
        raise ValueError(f"a namespace for an ACL key pattern must be plain (no glob characters or spaces), "
                         f"got {namespace!r}")
    return ["on", f">{password}", "resetkeys", f"~{key_pattern(namespace)}", "resetchannels", "-@all",
            *(f"+{command}" for command in COMMANDS)]


def acl_setuser_line(user: str, namespace: str, password: str = "<password>") -> str:
    """The command a Redis admin runs (redis-cli) to create the job's user."""
    return " ".join(["ACL", "SETUSER", user, *acl_rules(namespace, password)])
