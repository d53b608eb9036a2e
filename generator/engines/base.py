"""What every engine provides: token ids in, token ids + processed logprobs + per-token versions out.

Engines: `vllm` (AsyncLLM), `sglang` (sglang.Engine, CUDA only), `hf` (plain transformers, the reference).
They share this interface:
  await start(); await sample(prompt_ids, sampling, n) -> list[Completion];
  await load_weights(staged, fallback); await close(); attributes `version` and `resumed_requests` (requests a
  weight update aborted and the engine resubmitted with their prefix: vLLM's update_mode=abort).
`staged` is a complete, verified version in the generator's staging mapping (weightsync/receiver.py); `fallback` is
the last good one (None: the model's own files). A load either completes or goes back to `fallback` and raises
WeightLoadError; if going back fails too, it raises EngineBroken and never samples again. No engine ever samples
from partly loaded weights.
"""
from dataclasses import dataclass, field


@dataclass
class Completion:
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # logprob of each token under the distribution sampled from
    versions: list = field(default_factory=list)  # policy version of the weights that sampled each token
    finish_reason: str = "length"


class WeightLoadError(RuntimeError):
    """Loading new weights failed; the engine is back on its last good version."""


class EngineBroken(WeightLoadError):
    """A load failed and so did the reload of the last good version: the engine holds weights nobody can vouch
    for, so it stays paused and every later sample raises this. Only a restart brings it back."""


class EngineUnsupported(RuntimeError):
    """The installed engine library is a version this code was not tested against; the message says which versions
    are known to work and what to install. Raised by `start()` before any engine is built."""


def make_engine(name: str, **kwargs):
    """Engines are imported lazily: vLLM is heavy and may be absent (then use `hf`)."""
    if name == "vllm":
        try:
            from asyncrl.generator.engines.vllm_engine import VllmEngine
        except ImportError as err:
            raise RuntimeError(
                f"generator.engine=vllm but vLLM cannot be imported ({err}); install the `cpu` or `gpu` extra, "
                "or use generator.engine=hf"
            ) from None
        return VllmEngine(**kwargs)
    if name == "sglang":
        from asyncrl.generator.engines.sglang_engine import SglangEngine

        if kwargs.get("engine_factory") is None:  # a test's fake needs no SGLang
            try:
                import sglang  # noqa: F401
            except ImportError as err:
                raise RuntimeError(
                    f"generator.engine=sglang but SGLang cannot be imported ({err}); it needs CUDA "
                    "(pip install 'asyncrl[sglang]', in an environment without vLLM), or use "
                    "generator.engine=vllm or hf"
                ) from None
        return SglangEngine(**kwargs)
    if name == "hf":
        from asyncrl.generator.engines.hf_engine import HfEngine

        return HfEngine(**kwargs)
    raise ValueError(f"unknown engine {name!r}")
