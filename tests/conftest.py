"""Shared fixtures: the cached demo model (built once per session into a temp dir) and free ports."""
import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """Files holding a slow test first, the rest after, each in collection order. scripts/test hands whole files to
    two xdist workers in this order (--dist loadfile --no-loadscope-reorder): xdist's own order, most tests first,
    put the one-test end-to-end files of a minute or more last, and one worker ran them alone while the other had
    finished (the slowest, the soak, is six minutes)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory, request):
    """A demo cache dir shared by the session; tests that need the demo model build it once here. Under
    pytest-xdist (scripts/test runs two workers) every worker uses the same one, beside the workers' own temp dirs:
    launch/demo.py builds under a file lock, so the first worker builds and the other waits and reuses it."""
    if os.environ.get("ASYNCRL_TEST_DEMO_CACHE"):
        return os.environ["ASYNCRL_TEST_DEMO_CACHE"]
    if hasattr(request.config, "workerinput"):  # an xdist worker (its environment reaches subprocesses: not that)
        path = tmp_path_factory.getbasetemp().parent / "demo-cache"
        path.mkdir(exist_ok=True)
        return str(path)
    return str(tmp_path_factory.mktemp("demo-cache"))


DEMO = ["demo.sft_steps=60", "demo.num_prompts=256"]
"""The tests' demo: 256 prompts and the recipe's own 60-step warm start (about 6 s more to build, once per session).
A 20-step one sampled a reward of 0.003, so every job with dynamic sampling filtered about 70 groups for each it
trained on, and spent most of its time there."""


@pytest.fixture(scope="session")
def demo_assets(demo_cache):
    """(model_dir, [train parquet]) of the tests' demo (DEMO)."""
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import prepare_demo

    cfg = load_config(None, [f"demo.cache_dir={demo_cache}", *DEMO])
    return prepare_demo(cfg.demo, cfg.job.seed, say=lambda message: None)


VLM_DEMO = ["demo.task=square_colour", "demo.hidden_size=64", "demo.num_layers=2", "demo.num_prompts=256"]
"""The vision demo as configs/vlm_cpu.yaml builds it (a tiny random-init Qwen2.5-VL, no warm start), fewer rows."""


@pytest.fixture(scope="session")
def vlm_assets(demo_cache):
    """(model_dir, [train parquet]) of the tests' vision demo (VLM_DEMO): a few seconds to build, once."""
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import prepare_demo

    cfg = load_config(None, [f"demo.cache_dir={demo_cache}", *VLM_DEMO])
    return prepare_demo(cfg.demo, cfg.job.seed, say=lambda message: None)


class RedisServer:
    """A real redis-server (Debian's binary) on a free 127.0.0.1 port in its own directory, stopped by PID."""

    def __init__(self, directory: str, appendfsync: str = "always", extra: tuple = ()):
        self.directory, self.appendfsync, self.extra = directory, appendfsync, extra
        self.port = free_port()
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        import subprocess
        import time

        import redis

        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
                   "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "",
                   "--maxmemory-policy", "noeviction", *self.extra]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
            time.sleep(0.02)
        client.close()
        return self

    def kill(self, sig=None) -> None:
        import signal
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:  # a shutdown stuck behind an AOF rewrite: it is a test server
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server for the session's Redis tests (each test uses its own job name, so keys never collide)."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/ensure_redis installs Debian's package)")
    server = RedisServer(str(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.kill()
