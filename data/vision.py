"""A vision-language model's side of the data: which class loads it, and the inputs its forward takes for a row's
images. The generator's hf engine and the learner both build their inputs here, so both see the same pixels, the
same widened prompt and the same positions; a logprob the engine samples with is the one the learner recomputes.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense) are the families supported: a prompt travels with one `<|image_pad|>`
per image (the form vLLM takes, and the one the learner's dealt row digest covers); the model's forward takes each
pad widened to the image's merged patch count, with 3-row M-RoPE positions computed by the model's own
`get_rope_index`.
"""
from dataclasses import dataclass

from asyncrl.data.images import decode_image, expand_image_pads, pads_per_image

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""The vision-language families asyncrl trains: their prompts, processors and positions are the ones built here."""


class VisionError(ValueError):
    """A vision-language model asyncrl cannot train, or a job setting a vision model cannot take."""


def is_vision(config) -> bool:
    """Whether an HF config is a vision-language model's (it nests a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def is_vision_dir(path: str) -> bool:
    """Whether a model directory holds a vision-language model, from its config.json alone (no transformers)."""
    import json
    import os

    try:
        with open(os.path.join(path, "config.json")) as handle:
            return "vision_config" in json.load(handle)
    except (OSError, ValueError, TypeError):
        return False  # the engine's own load reports a missing or broken directory


def auto_model_class(config):
    """The transformers auto class that loads a causal model of `config`: image-text-to-text for a vision-language
    model (transformers maps those to no causal-LM class), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if not is_vision(config):
        return AutoModelForCausalLM
    if config.model_type not in VISION_MODEL_TYPES:
        raise VisionError(f"vision-language model type {config.model_type!r} is not supported: asyncrl trains "
                          f"{', '.join(VISION_MODEL_TYPES)}")
    return AutoModelForImageTextToText


def text_config(config):
    """The config of the model's text decoder (a vision-language config nests it; a text model's is itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass
class VisionInputs:
    """One sequence's or one batch's vision inputs, in the order of the image pads in its ids."""
    pixel_values: "object"
    """[patches, C·t·p²] float32: every image's patches, concatenated."""
    image_grid_thw: "object"
    """[images, 3] long: each image's (t, h, w) patch grid."""


class VisionProcessor:
    """A model directory's image processor and the ids its prompts use. `process` turns a row's encoded images into
    the forward's inputs; `widen` turns a travelling prompt into the forward's. Images are decoded through
    data/images.py's bounded decoder: they came from a parquet file or a deal, and are untrusted."""

    def __init__(self, image_processor, image_token_id: int, max_pixels: int):
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.merge_size = int(image_processor.merge_size)
        self.max_pixels = max_pixels

    @classmethod
    def from_model_dir(cls, path: str, config, max_pixels: int = 1 << 22) -> "VisionProcessor":
        """The processor saved beside a vision-language model. transformers' PIL backend, not its torchvision one:
        no CPU torchvision exists for this torch (docs/platform.md)."""
        from transformers import Qwen2VLImageProcessorPil

        try:
            processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        except OSError as err:
            raise VisionError(f"model {path} is a vision-language model without its image processor "
                              f"(preprocessor_config.json): {err}") from None
        vision = config.vision_config
        for name, ours in (("patch_size", vision.patch_size), ("merge_size", vision.spatial_merge_size),
                           ("temporal_patch_size", vision.temporal_patch_size)):
            if getattr(processor, name) != ours:
                raise VisionError(f"model {path}: its image processor's {name} is {getattr(processor, name)}, its "
                                  f"vision tower's {ours}")
        return cls(processor, config.image_token_id, max_pixels)

    def process(self, images: list) -> VisionInputs:
        """Encoded images (bytes) -> the forward's pixel values and grids."""
        import torch

        decoded = [decode_image(image, self.max_pixels) for image in images]
        out = self.image_processor(images=decoded, return_tensors="pt")
        return VisionInputs(out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.long))

    def pads_of(self, image: bytes) -> int:
        """How many image pads one encoded image widens to (decoding it: a row's images are checked at load)."""
        width, height = decode_image(image, self.max_pixels).size
        patches = self.image_processor.get_number_of_image_patches(height, width)
        return patches // (self.merge_size * self.merge_size)

    def pad_counts(self, inputs: VisionInputs) -> list[int]:
        return pads_per_image(inputs.image_grid_thw.tolist(), self.merge_size)

    def widen(self, ids: list, inputs: VisionInputs) -> list:
        """A travelling prompt (one pad per image) -> the forward's (each pad repeated to its image's patches)."""
        return expand_image_pads(ids, self.image_token_id, self.pad_counts(inputs))


SUPPRESSED_LOGIT = -1e4
"""The logit both the engine and the learner give a vision-language model's placeholder tokens before the
temperature: exp() of it is 0 in float32, so they are never sampled, and a prompt position whose target is one
(the prompt's image pads) still has a finite logprob (it trains nothing, but -inf times a 0 mask is nan)."""


def placeholder_tokens(config) -> tuple:
    """The ids a vision-language model's completions never hold: its image and video pads and the vision span's
    ends. A sampled image pad would be taken for an image by the next forward (the model scatters image features
    into every pad), so the engines never sample them and the buffer refuses a completion with one."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return tuple(sorted({int(getattr(config, name)) for name in names if getattr(config, name, None) is not None}))


def suppress(logits, token_ids: tuple):
    """[N, V] logits with `token_ids` set to SUPPRESSED_LOGIT (out of place: the learner's autograd keeps it)."""
    import torch

    return logits.index_fill(-1, torch.tensor(token_ids, device=logits.device), SUPPRESSED_LOGIT)


def vision_processor(model_path: str, trust_remote_code: bool = False, max_pixels: int = 1 << 22) -> VisionProcessor:
    """The VisionProcessor of the vision-language model at `model_path`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    auto_model_class(config)  # refuses a family asyncrl does not train
    return VisionProcessor.from_model_dir(model_path, config, max_pixels)


def rope_positions(model, input_ids, attention_mask, grids):
    """M-RoPE positions [3, B, L] of a batch of widened rows (padding at 0), from the model's own `get_rope_index`:
    images take their grid's 2-D positions, text after an image resumes past it. `grids` are the batch's image grids
    in the order of the pads, row by row; a batch without images gets 1-D positions counted from each row's first
    token, on all three rows (what the model computes for text)."""
    import torch

    if grids is None or len(grids) == 0:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return positions.unsqueeze(0).expand(3, -1, -1).contiguous()
    config = model.config
    types = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()
    positions, _ = model.model.get_rope_index(input_ids, types, image_grid_thw=grids, attention_mask=attention_mask)
    return positions.to(torch.long)
