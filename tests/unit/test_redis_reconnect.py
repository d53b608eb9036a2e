"""The retry policy's logic, with a fake operation and clock: resends through connection errors, restores state
before each resend, counts the outage, and gives up after its patience with a message naming the server."""
import pytest
import redis

from asyncrl.buffer.redis.reconnect import Reconnecting, RedisUnavailable


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def flaky(failures: int, error=redis.ConnectionError("Connection refused")):
    calls = []

    def operation(value):
        calls.append(value)
        if len(calls) <= failures:
            raise error
        return value * 2

    return operation, calls


def test_resends_through_an_outage_restoring_state_first():
    clock = FakeClock()
    retry = Reconnecting("redis://u:secret@host:6379/0", patience_s=10, sleep=clock.sleep, clock=clock)
    restored = []
    retry.on_reconnect(lambda: restored.append(clock.now))
    operation, calls = flaky(3)
    assert retry("XACK", operation, 21) == 42
    assert calls == [21] * 4 and len(restored) == 3 and retry.outages == 1  # restore ran before every resend
    assert retry("XACK", operation, 1) == 2 and retry.outages == 1  # a healthy call restores nothing


def test_timeouts_and_loading_are_waited_out_too():
    clock = FakeClock()
    retry = Reconnecting("redis://host:6379/0", patience_s=10, sleep=clock.sleep, clock=clock)
    for error in (redis.TimeoutError("read timed out"), redis.BusyLoadingError("LOADING")):
        operation, _ = flaky(2, error)
        assert retry("XREADGROUP", operation, 1) == 2


def test_gives_up_after_its_patience_naming_the_server_without_the_password():
    clock = FakeClock()
    retry = Reconnecting("redis://u:secret@host:6379/0", patience_s=5, sleep=clock.sleep, clock=clock)
    operation, calls = flaky(10_000)
    with pytest.raises(RedisUnavailable) as err:
        retry("admission", operation, 1)
    assert "host:6379" in str(err.value) and "secret" not in str(err.value)
    assert "admission" in str(err.value) and "redis.reconnect_s=5" in str(err.value)
    assert 5 <= clock.now < 7 and 5 < len(calls) < 40  # backoff, not a spin


def test_other_errors_are_not_retried_and_within_shortens_the_patience():
    clock = FakeClock()
    retry = Reconnecting("redis://host:6379/0", patience_s=100, sleep=clock.sleep, clock=clock)
    operation, calls = flaky(1, redis.ResponseError("WRONGTYPE"))
    with pytest.raises(redis.ResponseError):
        retry("XADD", operation, 1)
    assert calls == [1]
    operation, _ = flaky(10_000)
    with pytest.raises(RedisUnavailable):
        retry.within(2)("bye", operation, 1)
    assert clock.now < 4
