"""The least-privilege Redis user (buffer/redis/acl.py) on a real redis-server: asyncrl's server checks pass as
that user, and everything outside its commands and its job's keys is refused. The whole protocol runs as such a
user in tests/e2e/test_exactly_once.py's Redis case (real learners and generators, dealing, evaluation, kills -9
of a generator and of the learner), whose ACL LOG then holds nothing but the CONFIG GET the server checks try before
reading INFO."""
import uuid

import pytest

from asyncrl.buffer.redis.acl import acl_rules, acl_setuser_line, key_pattern
from asyncrl.buffer.redis.conn import RedisOptions, check_server, configure_durability, connect
from tests.integration.helpers import create_job_user, denials, user_url

pytestmark = pytest.mark.redis


def test_the_job_user_may_run_asyncrl_and_nothing_else(redis_server):
    import redis

    admin = connect(RedisOptions(redis_server.url))
    namespace = f"acl{uuid.uuid4().hex[:6]}"
    user, password = create_job_user(admin, namespace)
    try:
        url = user_url(redis_server, user, password)
        client = connect(RedisOptions(url))
        check_server(client, url)  # CONFIG GET is refused: the check reads INFO instead
        assert "AOF" in configure_durability(client, url, "")
        key = key_pattern(namespace).replace("*", "meta")
        client.hset(key, "x", "1")
        assert client.hget(key, "x") == b"1"
        for refused in (lambda: client.flushall(), lambda: client.config_set("appendonly", "no"),
                        lambda: client.keys("*"), lambda: client.set("other:key", "1"),
                        lambda: client.get(key_pattern("another-job").replace("*", "meta")),
                        lambda: client.publish("channel", "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
        with pytest.raises(Exception, match="CONFIG SET"):  # asking for durability needs an admin, and says so
            configure_durability(client, url, "everysec")
        assert {"command", "key"} <= {reason for reason, _ in denials(admin, user)}  # Redis logged each refusal
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_the_rules_name_the_job_and_refuse_a_pattern_as_a_namespace():
    line = acl_setuser_line("asyncrl-gen", "myjob")
    assert line.startswith("ACL SETUSER asyncrl-gen on ><password> resetkeys ~asyncrl:{myjob}:* resetchannels -@all ")
    assert "+xreadgroup" in line and "+evalsha" in line and "+config" not in line and "+flushall" not in line
    with pytest.raises(ValueError, match="plain"):
        acl_rules("job*", "pw")
