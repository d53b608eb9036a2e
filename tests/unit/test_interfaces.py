"""The declared interfaces between the processes (buffer/interface.py) are what both backends implement and all that
their callers use: every Protocol method exists on each backend with the same parameters (and is a coroutine
exactly where the Protocol's is), and the learner and the rollout loop touch nothing else of a buffer."""
import ast
import inspect
import json
import os
from typing import Protocol

import pytest

from asyncrl.buffer.interface import GeneratorBuffer, LearnerBuffer, RunInfo, RunInfoError
from asyncrl.buffer.redis.client import RedisBufferClient
from asyncrl.buffer.redis.server import RedisBufferServer
from asyncrl.buffer.zmq.client import ZmqBufferClient
from asyncrl.buffer.zmq.server import ZmqBufferServer
from tests.messages import run_info

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def protocol_members(protocol) -> dict:
    """name -> function for the methods, name -> None for the attributes, that `protocol` declares."""
    members = {name: value for name, value in vars(protocol).items()
               if inspect.isfunction(value) and not name.startswith("_")}
    members.update({name: None for name in getattr(protocol, "__annotations__", {})})
    return members


def parameters(function) -> list:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()][1:]  # without self


@pytest.mark.parametrize("protocol, implementation", [
    (LearnerBuffer, ZmqBufferServer), (LearnerBuffer, RedisBufferServer),
    (GeneratorBuffer, ZmqBufferClient), (GeneratorBuffer, RedisBufferClient)])
def test_each_backend_implements_its_protocol_with_the_same_signatures(protocol, implementation):
    assert issubclass(protocol, Protocol)
    for name, declared in protocol_members(protocol).items():
        if declared is None:  # an attribute: set in __init__
            assert name in inspect.getsource(implementation.__init__), (implementation.__name__, name)
            continue
        actual = getattr(implementation, name, None)
        assert actual is not None, f"{implementation.__name__} lacks {name}"
        assert parameters(actual) == parameters(declared), (implementation.__name__, name)
        assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(declared), name


def attributes_used_on(path: str, names: set) -> set:
    """Attribute names accessed on any variable or attribute called one of `names` (e.g. `buffer.take`,
    `self.client.admit`) in the module at `path`; the config's sections (`cfg.buffer.port`) are not buffers."""
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        target = node.value
        if isinstance(target, ast.Name) and target.id in names:
            used.add(node.attr)
        elif isinstance(target, ast.Attribute) and target.attr in names and not is_config(target.value):
            used.add(node.attr)
    return used


def is_config(node) -> bool:
    return (isinstance(node, ast.Name) and node.id == "cfg") or (isinstance(node, ast.Attribute) and node.attr == "cfg")


@pytest.mark.parametrize("path", ["learner/loop.py", "learner/host.py", "learner/collect.py", "learner/state.py"])
def test_the_learner_uses_only_the_learner_buffer_protocol(path):
    used = attributes_used_on(path, {"buffer"})
    assert used <= set(protocol_members(LearnerBuffer)), used - set(protocol_members(LearnerBuffer))


@pytest.mark.parametrize("path", ["generator/rollout.py", "generator/main.py"])
def test_the_generator_uses_only_the_generator_buffer_protocol(path):
    used = attributes_used_on(path, {"client"})
    assert used <= set(protocol_members(GeneratorBuffer)), used - set(protocol_members(GeneratorBuffer))


def test_no_caller_asks_a_buffer_what_it_can_do():
    """Backend-specific code is reached through the protocol, never by probing the object (`hasattr`)."""
    for path in ("learner/loop.py", "learner/host.py", "learner/collect.py", "learner/state.py",
                 "generator/rollout.py", "generator/main.py", "generator/weights.py", "generator/sampling.py"):
        tree = ast.parse(open(os.path.join(REPO, path)).read())
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                 and node.func.id in ("hasattr", "getattr")]
        assert not calls, (path, [ast.unparse(call) for call in calls])


def test_run_info_survives_the_wire_and_a_malformed_one_names_the_learner_and_the_field():
    info = run_info(train_files=("/data/a.parquet",), lora_rank=8, deals=True, data_sources=("gsm8k",),
                    deal_timeout_s=60.0, evals=True, model_files="abc")
    assert RunInfo.from_wire(json.loads(json.dumps(info.to_wire())), "tcp://l:1") == info
    wire = info.to_wire()
    for broken, named in (({k: v for k, v in wire.items() if k != "job"}, "without 'job'"),
                          ({**wire, "lora_rank": True}, "'lora_rank' is bool"),
                          ({**wire, "train_files": "/data/a.parquet"}, "'train_files' is str"),
                          ({**wire, "deals": 1}, "'deals' is int"), ("info", "not a mapping")):
        with pytest.raises(RunInfoError, match=f"learner at tcp://l:1 .*{named}"):
            RunInfo.from_wire(broken, "tcp://l:1")
