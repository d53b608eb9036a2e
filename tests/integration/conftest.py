"""Fixtures shared by the integration tests."""
import asyncio

import pytest

from tests.integration.helpers import VOCAB
from tests.redis_dealing_job import Job


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from asyncrl.learner.model import build_qwen2

    path = str(tmp_path_factory.mktemp("tiny-model"))
    model = build_qwen2(vocab_size=VOCAB, hidden_size=32, num_layers=1, eos_token_id=1, pad_token_id=0, seed=0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def event_loop_runner():
    """One event loop for the session's vLLM engine: its background output handler lives on the loop it started on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def vllm_engine(demo_assets, event_loop_runner):
    """The real vLLM CPU engine on the demo model, started once and shared by every test module that names it
    (starting one takes most of a minute). A test that loads other weights or switches update_mode restores them."""
    from asyncrl.generator.engines.base import EngineOptions
    from asyncrl.generator.engines.vllm_engine import VllmEngine

    engine = VllmEngine(EngineOptions(demo_assets[0], dtype="float32", max_model_len=64, kv_cache_gib=0.25, seed=0))
    event_loop_runner.run_until_complete(engine.start())
    yield engine
    event_loop_runner.run_until_complete(engine.close())


@pytest.fixture
def make_job(redis_server):
    """make(count, **kwargs) -> a Job (tests/redis_dealing_job.py) on the session's redis-server, closed after the
    test."""
    jobs = []

    def make(count, **kwargs):
        jobs.append(Job(redis_server.url, count, **kwargs))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()
