"""A version's tensors in the layout of the model's checkpoint files, the one vLLM loads.

The learner publishes its state dict as transformers 5 holds it in memory, which is not always how the files hold
it: transformers converts some weights on load. A mixture-of-experts layer's experts are one 3-D tensor per
projection in memory (`mlp.experts.gate_up_proj`, [experts, 2 * intermediate, hidden]) and one 2-D tensor per expert
and projection in the files (`mlp.experts.0.gate_proj.weight`). vLLM's loaders read the files' layout; a few also
take the fused one (Qwen3-MoE), most do not (DeepSeek-V2/V3), and the generator's check of a version against the
checkpoint (vllm_engine.py::check_against_checkpoint) compares with the files' names; SGLang's loaders read the
files' layout too. So both engines convert every staged version back with transformers' own reverse conversion
(`revert_weight_conversion`, what `save_pretrained` runs before it writes), on a model of the same config built on
the meta device (no memory): vLLM the shapes in the generator's process and the tensors in its worker
(vllm_transfer.py), SGLang the tensors it hands `update_weights_from_tensor` (sglang_receiver.py). A model
transformers converts nothing for passes through unchanged, without a copy.

The reverse of each conversion transformers ships takes one in-memory tensor to one or more files' tensors, so a
bucket converts on its own: a fused tensor is never split across buckets (weightsync/layout.py). The `hf` engine
loads the in-memory layout as published and needs none of this.
"""
import logging
import os

import torch

log = logging.getLogger(__name__)


class CheckpointLayout:
    """Converts (name, tensor) pairs from a model's in-memory layout to its files' layout. `model`: a meta-device
    transformers model whose class and config say what transformers converts (None: nothing is converted)."""

    def __init__(self, model=None):
        self.model = model

    @classmethod
    def for_config(cls, config, trust_remote_code: bool = False) -> "CheckpointLayout":
        """The layout of a model with transformers config `config`. A model transformers cannot build from its
        config (a custom architecture, a config class of vLLM's own) is loaded as published, with a warning: its
        in-memory and files' layouts are then whatever its own code makes them."""
        from transformers.conversion_mapping import get_model_conversion_mapping

        from asyncrl.data.vision import auto_model_class

        try:
            with torch.device("meta"):
                model = auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code)
        except Exception as err:  # noqa: BLE001 - any failure means: no conversion known
            log.warning("weights are loaded as the learner names them: transformers could not build a %s model to "
                        "learn its checkpoint layout (%s)", getattr(config, "model_type", "?"), err)
            return cls(None)
        if not get_model_conversion_mapping(model, add_legacy=False):
            return cls(None)
        return cls(model)

    @classmethod
    def for_model_dir(cls, model_path: str, trust_remote_code: bool = False) -> "CheckpointLayout":
        from transformers import AutoConfig

        if not os.path.isfile(os.path.join(model_path, "config.json")):  # never a hub lookup: models are local
            log.warning("weights are loaded as the learner names them: %s has no config.json", model_path)
            return cls(None)
        try:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            log.warning("weights are loaded as the learner names them: no transformers config in %s (%s)",
                        model_path, err)
            return cls(None)
        return cls.for_config(config, trust_remote_code)

    @property
    def converts(self) -> bool:
        return self.model is not None

    def convert(self, named_tensors) -> list:
        """The (name, tensor) pairs of one bucket, in the files' layout (views where the conversion splits)."""
        if self.model is None:
            return list(named_tensors)
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self.model, dict(named_tensors)).items())

    def shapes(self, names, shapes) -> dict:
        """name -> shape in the files' layout, of the tensors an announcement names (converted as meta tensors)."""
        meta = [(name, torch.empty(tuple(shape), device="meta")) for name, shape in zip(names, shapes)]
        return {name: tuple(tensor.shape) for name, tensor in self.convert(meta)}
