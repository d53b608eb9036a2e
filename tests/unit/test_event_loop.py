"""The generator's event loop: uvloop by default, plain asyncio on request or when uvloop is missing."""
import asyncio
import sys

import pytest

from asyncrl.generator.event_loop import run


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_runs_by_default_and_asyncio_on_request():
    pytest.importorskip("uvloop")
    assert run(loop_module()).startswith("uvloop")
    assert run(loop_module(), "asyncio").startswith("asyncio")


def test_without_uvloop_the_loop_is_plain_asyncio(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what `import uvloop` sees when it is not installed
    assert run(loop_module()).startswith("asyncio")


def test_an_unknown_loop_is_refused_by_the_config_and_the_runner():
    from asyncrl.configs import load_config

    with pytest.raises(ValueError, match="generator.event_loop must be uvloop or asyncio"):
        load_config(None, ["generator.event_loop=trio"])
    coroutine = loop_module()
    with pytest.raises(ValueError, match="event loop must be one of"):
        run(coroutine, "trio")
    coroutine.close()
