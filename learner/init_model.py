"""A new model for a new task (`asyncrl init-model`): a tokenizer trained on the task's text and a small randomly
initialised model of a supported family, written as an HF model directory that every part loads (learner/model.py,
the hf and vLLM engines). `asyncrl sft` then warms it up. The demo's base model (launch/demo.py) is built by the same
functions.

Only stdlib at module level: launch/cli.py reads FAMILIES while building its parser, and `--help` stays fast.
"""
import os
import shutil
from dataclasses import dataclass

FAMILIES = ("qwen2", "qwen3", "llama")
"""The families a model is built in: each is loaded by transformers and by vLLM with the tokenizer built here
(learner/tokenizer.py). learner/families.py's other families (Mistral, Gemma 2, Qwen3-MoE, DeepSeek-V3) are tested in
the learner from their tiny test shapes, but have settings (sliding windows, soft-capping, experts, latent
attention) a new model should choose on purpose: bring such a model's directory instead."""
PAD_MULTIPLE = 16
"""The vocabulary is padded to a multiple of this (ids past the tokenizer's are never sampled once SFT has
trained the model on the real ones)."""
RENDERED_CONVERSATIONS = 64
"""Conversations of the corpus rendered with the chat template: the template's own text is the same in each."""


class InitModelError(ValueError):
    """A model that cannot be built as asked; the message names the option and what works."""


@dataclass(frozen=True)
class ModelShape:
    family: str = "qwen2"
    hidden_size: int = 128
    num_layers: int = 4
    heads: int = 0
    """Attention heads; 0: one per 32 of hidden_size (head_dim 32, which vLLM's CPU attention supports)."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: as many as heads."""
    max_positions: int = 512
    """The longest sequence (prompt and response) the model takes."""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise InitModelError(f"model family {self.family!r} is not one init-model builds; supported: "
                                 f"{', '.join(FAMILIES)}")
        if self.hidden_size < 1 or self.num_layers < 1 or self.max_positions < 2:
            raise InitModelError(f"hidden size, layers and max positions must be >= 1, 1 and 2; got "
                                 f"{self.hidden_size}, {self.num_layers}, {self.max_positions}")
        heads, kv_heads = self.attention_heads()
        if self.hidden_size % heads or heads % kv_heads:
            raise InitModelError(f"hidden size {self.hidden_size} must divide into {heads} heads, and the heads "
                                 f"into {kv_heads} key/value heads (e.g. --hidden 128 --heads 4 --kv-heads 2)")

    def attention_heads(self) -> tuple[int, int]:
        heads = self.heads or max(1, self.hidden_size // 32)
        return heads, self.kv_heads or heads


def padded_vocab(tokens: int, multiple: int = PAD_MULTIPLE) -> int:
    return ((tokens + multiple - 1) // multiple) * multiple


def build_model(shape: ModelShape, vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int):
    """A randomly initialised causal LM of `shape`, fp32, seeded: 4x-wide MLP, tied embeddings, the family's
    defaults otherwise. A qwen2 model is exactly learner/model.py::build_qwen2's (the demo's measured models)."""
    import torch
    import transformers

    heads, kv_heads = shape.attention_heads()
    common = dict(vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=4 * shape.hidden_size,
                  num_hidden_layers=shape.num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=shape.max_positions, tie_word_embeddings=True,
                  eos_token_id=eos_token_id, bos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if shape.family == "qwen2":
        config, model_class = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif shape.family == "qwen3":  # Qwen3's default head_dim is 128 whatever the width
        config = transformers.Qwen3Config(head_dim=shape.hidden_size // heads, **common)
        model_class = transformers.Qwen3ForCausalLM
    else:
        config = transformers.LlamaConfig(head_dim=shape.hidden_size // heads, **common)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    return model_class(config)


VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
"""The vision-language families build_vision_model builds (data/vision.py trains these and Qwen2-VL)."""


def build_vision_model(family: str, vocab_size: int, tokenizer, seed: int, max_positions: int = 128,
                       hidden_size: int = 64, num_layers: int = 2):
    """A randomly initialised tiny vision-language model (fp32, seeded) and its image processor, for the vision demo
    and tests: a 2-block vision tower of width 32 whose merger outputs the text model's width, text head_dim 32
    (vLLM's CPU attention takes it) with M-RoPE sections summing to half of it, untied head (both families' own).
    `qwen2_5_vl`: 14-pixel patches, windowed attention in the first block; `qwen3_vl`: 16-pixel patches, learned
    position embeddings and DeepStack features from the first block into the text model, interleaved M-RoPE. The
    vision token ids are the tokenizer's (`<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`).
    Images are resized to between 4 and 16 merged patches each (4 to 16 image pads)."""
    import torch
    import transformers

    if family not in VISION_FAMILIES:
        raise InitModelError(f"vision family must be one of {VISION_FAMILIES}, got {family!r}")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    if tokenizer.unk_token_id in ids.values() or None in ids.values():
        raise InitModelError(f"the tokenizer lacks a vision token: {ids}")
    heads = hidden_size // 32
    patch = 14 if family == "qwen2_5_vl" else 16
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                  patch_size=patch, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    rope = {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0}
    text = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=max_positions, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            vision_config={**vision, "window_size": 56, "fullatt_block_indexes": [1]},
            text_config={**text, "rope_parameters": rope, "bos_token_id": tokenizer.eos_token_id},
            tie_word_embeddings=False, **ids)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        config = transformers.Qwen3VLConfig(
            vision_config={**vision, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
            text_config={**text, "head_dim": hidden_size // heads, "rope_parameters": {**rope, "mrope_interleaved": True}},
            tie_word_embeddings=False, **ids)
        model_class = transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(config)
    side = patch * 2
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=(2 * side) ** 2, max_pixels=(4 * side) ** 2,
                                                     patch_size=patch, merge_size=2, temporal_patch_size=2)
    return model, processor


def save_model_dir(out_dir: str, model, tokenizer) -> None:
    """The model, its generation config (EOS: sampling stops at the end of a turn) and the tokenizer."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@dataclass
class InitResult:
    path: str
    family: str
    parameters: int
    tokens: int
    """The tokenizer's size."""
    vocab_size: int
    """The model's vocabulary: tokens padded to PAD_MULTIPLE."""
    texts: int
    """Corpus texts the tokenizer was trained on and gives back exactly."""
    rendered: int
    """Conversations rendered with the chat template and given back exactly."""


def init_model(out_dir: str, corpus_paths: list, shape: ModelShape, spec=None, seed: int = 0,
               overwrite: bool = False) -> InitResult:
    """Trains the tokenizer on the corpus (data/corpus.py) and the chat template's renderings of its conversations,
    builds the model, writes both into `out_dir` and checks that the directory's tokenizer, loaded as every part
    loads it, gives back every text and rendering (learner/tokenizer.py::check_round_trip)."""
    from asyncrl.data.corpus import read_corpus
    from asyncrl.learner.tokenizer import TokenizerSpec, check_round_trip

    spec = spec or TokenizerSpec()
    if os.path.exists(os.path.join(out_dir, "config.json")) and not overwrite:
        raise InitModelError(f"{out_dir} already holds a model (config.json); choose another --out or pass --force "
                             f"to overwrite it")
    corpus = read_corpus(corpus_paths)
    tokenizer, rendered = train_with_template(corpus, spec)
    model = build_model(shape, padded_vocab(len(tokenizer)), tokenizer.eos_token_id, tokenizer.pad_token_id, seed)
    staging = out_dir.rstrip(os.sep) + ".init-model-tmp"  # a directory that fails the check is never in out_dir
    shutil.rmtree(staging, ignore_errors=True)
    try:
        save_model_dir(staging, model, tokenizer)
        check_round_trip(staging, corpus.texts + rendered, corpus.sources +
                         [f"the chat template's rendering of conversation {i}" for i in range(len(rendered))], name=out_dir)
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(staging):  # file by file: --force never deletes what else is in out_dir
            os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return InitResult(os.path.abspath(out_dir), shape.family, sum(p.numel() for p in model.parameters()),
                      len(tokenizer), model.config.vocab_size, len(corpus.texts), len(rendered))


def train_with_template(corpus, spec) -> tuple:
    """(tokenizer, renderings): trained on the corpus in its own and NFC form (Qwen2Tokenizer normalizes what it
    encodes to NFC, other families' tokenizers do not) and on the chat template's renderings of the corpus's
    conversations (with and without the generation prompt), so the template's own text is in the vocabulary."""
    import unicodedata

    from asyncrl.learner.tokenizer import train_tokenizer

    texts = corpus.texts + [unicodedata.normalize("NFC", text) for text in corpus.texts]
    roles = sorted({m["role"] for messages, _ in corpus.conversations for m in messages} | {"user", "assistant"})
    conversations = corpus.conversations[:RENDERED_CONVERSATIONS]
    conversations.append(([{"role": role, "content": "."} for role in roles], None))
    first = train_tokenizer(texts, spec)
    rendered = [render(first, messages, tools, prompt_only) for messages, tools in conversations
                for prompt_only in (False, True) if not (prompt_only and messages[0]["role"] == "assistant")]
    return train_tokenizer(texts + rendered, spec), rendered


def render(tokenizer, messages: list, tools, prompt_only: bool) -> str:
    """One conversation as text: whole, or up to its first assistant turn with the generation prompt (what the
    generator renders)."""
    if prompt_only:
        cut = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        messages = messages[:cut]
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=prompt_only)
