"""Demo task: sort a string of 4-7 digits (`sort:5021=` -> `0125`). Exact, verifiable, learnable on 2 CPU cores.

Rows follow verl's format so the same code reads a user's dataset: `prompt` (chat messages), `data_source`,
`reward_model.ground_truth`, `extra_info`.
"""
import random

from asyncrl.generator.tasks.exact_match import compute_score  # noqa: F401 (the task's reward)

DATA_SOURCE = "asyncrl/sort_digits"
ALPHABET = "0123456789sort:="
TOKENIZER_MODEL = "word_level"  # launch/demo.py train_char_tokenizer: why not byte_level
EOS = "<eos>"
SPECIAL_TOKENS = ["<pad>", EOS, "<unk>"]
ADDED_TOKENS: list = []
MAX_POSITIONS = 128
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""The contents, concatenated: the prompt is `sort:5021=` and the model writes the answer right after it."""


def make_rows(num_prompts: int, seed: int, min_len: int = 4, max_len: int = 7) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"sort:{digits}="}],
                "data_source": DATA_SOURCE,
                "reward_model": {"style": "rule", "ground_truth": "".join(sorted(digits))},
                "extra_info": {"index": index, "split": "train"},
            }
        )
    return rows


def sft_rows(num_rows: int, seed: int) -> list[dict]:
    """SFT rows for the warm start: the task's own rows, whose ground truth is the target (data/sft.py)."""
    return make_rows(num_rows, seed)


def tokenizer_corpus(seed: int) -> list[str]:
    """Text with every character the task uses, for the character tokenizer."""
    rows = make_rows(2000, seed)
    return [r["prompt"][0]["content"] + r["reward_model"]["ground_truth"] for r in rows] + [ALPHABET]
