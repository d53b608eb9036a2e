"""Tokenizers for a new model, trained on a task's own text: what `asyncrl init-model` (learner/init_model.py) and
the demo (launch/demo.py) build, and the round-trip check every one of them passes.

Why byte-level BPE. A model directory is loaded by `AutoTokenizer` in every part (learner/model.py::load_tokenizer,
the hf and vLLM engines), and for a directory whose config says `qwen2`, transformers 5 returns `Qwen2Tokenizer`
whatever `tokenizer_config.json` names: it rebuilds the pipeline as Qwen's (NFC, Qwen's split regex, byte-level) over
the vocabulary of `tokenizer.json` (docs/platform.md, "transformers 5 loads every Qwen2 directory's tokenizer as
Qwen2Tokenizer"). A byte-level BPE is exactly what it rebuilds, so any text of the vocabulary's characters survives;
with no merges it is a character tokenizer (one token per byte: one per ASCII character). A word-level vocabulary
loses every space and newline there without a warning. So every tokenizer built here is loaded back through
`AutoTokenizer` and must give the corpus back exactly (`check_round_trip`).
"""
import unicodedata
from dataclasses import dataclass

MODELS = ("byte_level", "bpe", "word_level")
"""byte_level: byte-level BPE with no merges (a character tokenizer); bpe: byte-level BPE with merges up to
`vocab_size` (frequent words and pieces become one token), split as Qwen2Tokenizer splits; word_level: a
character vocabulary without byte-level encoding, kept for the sort demo's cached assets (its text has no
whitespace; nothing else should use it)."""
CHATML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function.name') | join(', ') }}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen-style ChatML; with tools, a system turn naming them (the tool demo's template, generator/tasks/add_numbers.py:
a tiny model learns the call format in SFT, not from schemas)."""
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
"""Qwen2Tokenizer's pre-tokenizer split: a bpe tokenizer is trained on the pieces it will be applied to."""


@dataclass(frozen=True)
class TokenizerSpec:
    model: str = "byte_level"
    """One of MODELS."""
    special_tokens: tuple = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")
    """Special tokens, ids 0.. in this order; `<pad>`, `<unk>` and `eos` must be among them."""
    eos: str = "<|im_end|>"
    """The end of a turn, and the tokenizer's and the model's EOS."""
    added_tokens: tuple = ()
    """Ordinary (non-special) tokens added whole: they survive decoding (e.g. `<tool_call>`)."""
    chat_template: str = CHATML_TEMPLATE
    vocab_size: int = 0
    """bpe only: the vocabulary to train up to (merges stop there), special and added tokens not counted."""
    all_bytes: bool = False
    """Byte-level models: the 256 byte symbols are in the vocabulary whatever the corpus holds, so any text
    round-trips (a character the corpus lacks becomes its UTF-8 bytes) at the cost of ~200 more embedding rows."""

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"tokenizer model must be one of {MODELS}, got {self.model!r}")
        missing = [token for token in ("<pad>", "<unk>", self.eos) if token not in self.special_tokens]
        if missing:
            raise ValueError(f"special_tokens {self.special_tokens} lack {missing}")
        if self.model == "bpe" and self.vocab_size < 1:
            raise ValueError("a bpe tokenizer needs a vocabulary size its merges stop at: --vocab-size N (N >= 1)")
        if self.model != "bpe" and self.vocab_size:
            raise ValueError("a vocabulary size (--vocab-size) is for the bpe tokenizer only (--tokenizer bpe); "
                             "a character tokenizer's vocabulary is the corpus's characters")


class TokenizerRoundTripError(RuntimeError):
    """The tokenizer as every part loads it does not give a text back; the message says why and what to do."""


def train_tokenizer(corpus: list, spec: TokenizerSpec):
    """A `PreTrainedTokenizerFast` trained on `corpus` (a list of texts): every character of the corpus is in the
    vocabulary, and so is each special and added token; EOS, pad and unk set; the chat template attached."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = list(spec.special_tokens)
    if spec.model == "word_level":
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(special_tokens=special)
    else:
        tokenizer = Tokenizer(models.BPE())
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        if spec.model == "bpe":
            from tokenizers import Regex

            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"), byte_level])
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        options = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()} if spec.all_bytes else {}
        trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size + len(special) if spec.model == "bpe" else 1,
                                      special_tokens=special, show_progress=False, **options)
    tokenizer.train_from_iterator(corpus, trainer)
    if spec.added_tokens:
        tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in spec.added_tokens])
    others = [token for token in special if token not in (spec.eos, "<pad>", "<unk>")]
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=spec.eos, pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=others)
    fast.chat_template = spec.chat_template
    return fast


def check_round_trip(model_dir: str, texts: list, sources: list | None = None, name: str | None = None) -> None:
    """The tokenizer as every part loads it (AutoTokenizer) must give each text back exactly; the first that does
    not raises TokenizerRoundTripError naming the model (`name`, else `model_dir`), where the text came from
    (`sources[i]`), the first character that differs and what to do."""
    from asyncrl.learner.model import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    texts = list(texts)
    for start in range(0, len(texts), 1024):
        chunk = texts[start:start + 1024]
        ids = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        for offset, back in enumerate(tokenizer.batch_decode(ids)):
            if back != chunk[offset]:
                where = sources[start + offset] if sources else f"text {start + offset}"
                raise TokenizerRoundTripError(describe_mismatch(name or model_dir, type(tokenizer).__name__,
                                                                chunk[offset], back, where))


def describe_mismatch(name: str, loaded_as: str, text: str, back: str, where: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
    char = text[at] if at < len(text) else ""
    head = (f"the tokenizer of {name}, loaded as every part loads it ({loaded_as}), does not give back the "
            f"text of {where}: {text[max(0, at - 20):at + 40]!r} came back as {back[max(0, at - 20):at + 40]!r}")
    if unicodedata.normalize("NFC", text) == back:
        return (f"{head}. The text is not in Unicode NFC form and {loaded_as} normalizes to NFC: normalize your "
                f"data (unicodedata.normalize('NFC', text)) before training on it, or build a qwen3 or llama model, "
                f"whose tokenizer keeps the text as it is")
    if char:
        return (f"{head}. Its character {char!r} (U+{ord(char):04X} {unicodedata.name(char, '')}) is not in the "
                f"vocabulary: give a corpus file that has it (--corpus: every character the task's prompts, "
                f"answers and tool results use), or --all-bytes for a vocabulary that covers every text")
    return f"{head}. Rebuild with --all-bytes, or report the text"
