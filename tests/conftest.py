"""Shared fixtures: the cached demo model (built once per session into a temp dir) and free ports."""
import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """A demo cache dir shared by the session; tests that need the demo model build it once here."""
    path = os.environ.get("ASYNCRL_TEST_DEMO_CACHE") or str(tmp_path_factory.mktemp("demo-cache"))
    return path


@pytest.fixture(scope="session")
def demo_assets(demo_cache):
    """(model_dir, [train parquet]) of a small, fast demo: 20 SFT steps."""
    from asyncrl.configs import load_config
    from asyncrl.launch.demo import prepare_demo

    cfg = load_config(None, [f"demo.cache_dir={demo_cache}", "demo.sft_steps=20", "demo.num_prompts=256"])
    return prepare_demo(cfg.demo, cfg.job.seed, say=lambda message: None)
