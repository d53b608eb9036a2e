"""Every engine class satisfies the interface the generator types it by (generator/engines/base.py): `Engine`
for all, `PushableEngine` for those the learner may push versions into (generator/weights.py asks that
question instead of probing for methods), and the SGLang handle the sglang engine drives is implemented alike by
the real wrapper and the test fake. Built without starting: no model, vLLM or SGLang is needed."""
import inspect
from typing import Generic, Protocol

import pytest

from asyncrl.generator.engines.base import Engine, EngineOptions, PushableEngine, SglangOptions
from asyncrl.generator.engines.hf_engine import HfEngine
from asyncrl.generator.engines.sglang_engine import AsyncSglangEngine, SglangEngine, SglangHandle
from asyncrl.generator.engines.vllm_engine import VllmEngine
from tests.fakes.fake_sglang import FakeSglangEngine

OPTIONS = EngineOptions("/no/model", "float32", max_model_len=64, kv_cache_gib=0.1, seed=0)


def methods(protocol) -> dict:
    """name -> the protocol's function, for every method the protocol (and the protocols it extends) declares."""
    found = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, Generic, Protocol):
            continue
        found.update({name: value for name, value in vars(klass).items()
                      if callable(value) and not name.startswith("_")})
    return found


def check_methods(obj, protocol) -> None:
    """Beyond isinstance (which only sees names): each method is async where the protocol's is, and accepts the
    protocol's parameters by name."""
    for name, declared in methods(protocol).items():
        implemented = getattr(type(obj) if not inspect.isclass(obj) else obj, name)
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), name
        wanted = [p for p in inspect.signature(declared).parameters if p != "self"]
        params = inspect.signature(implemented).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            assert set(wanted) <= set(params), f"{type(obj).__name__}.{name} lacks {set(wanted) - set(params)}"


def sglang_on_fake() -> SglangEngine:
    return SglangEngine(EngineOptions(**{**vars(OPTIONS), "sglang": SglangOptions(engine_factory=FakeSglangEngine)}))


@pytest.mark.parametrize("build, pushable", [(lambda: HfEngine(OPTIONS), False), (lambda: VllmEngine(OPTIONS), True),
                                             (sglang_on_fake, True)], ids=["hf", "vllm", "sglang"])
def test_every_engine_is_an_engine_and_only_the_pushable_ones_are_pushable(build, pushable):
    engine = build()
    assert isinstance(engine, Engine)
    check_methods(engine, Engine)
    assert isinstance(engine, PushableEngine) == pushable
    if pushable:
        check_methods(engine, PushableEngine)
        assert engine.push_kind in ("vllm", "sglang") and engine.push_ranks == 1 and engine.broken is None


def test_the_fake_sglang_and_the_real_wrapper_implement_the_same_handle(tmp_path):
    fake = FakeSglangEngine(model_path=str(tmp_path))
    assert isinstance(fake, SglangHandle)
    check_methods(fake, SglangHandle)
    check_methods(AsyncSglangEngine, SglangHandle)  # the class: building one needs SGLang and CUDA


def test_an_object_missing_a_push_method_is_not_pushable():
    class Partial:
        version, resumed_requests, push_kind, push_ranks, broken = 0, 0, "vllm", 1, None

        async def start(self): ...
        async def sample(self, prompt_ids, sampling, n): ...
        async def load_weights(self, staged, fallback=None): ...
        async def close(self): ...
        def mark_broken(self, reason): ...
        async def push_init(self, init_info, transport="nccl"): ...

    assert isinstance(Partial(), Engine) and not isinstance(Partial(), PushableEngine)
