"""Demo assets, built on first use and cached: a character tokenizer trained with `tokenizers`, a tiny Qwen2, the
task's parquet dataset, and the SFT warm start. The cache key is the demo settings and the task's code, so changing
either rebuilds.
"""
import fcntl
import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict

from asyncrl.generator.tasks import add_numbers, add_subtract, sort_digits, square_colour

log = logging.getLogger(__name__)
TASKS = {"sort_digits": sort_digits, "add_numbers": add_numbers, "add_subtract": add_subtract,
         "square_colour": square_colour}
"""Each task module gives make_rows, sft_rows, tokenizer_corpus, its tokenizer's EOS, SPECIAL_TOKENS,
ADDED_TOKENS and CHAT_TEMPLATE, and the model's MAX_POSITIONS; a task whose prompts carry images sets VISION."""
SFT_MICROBATCH_TOKENS = 4096


def vision_task(task) -> bool:
    """Whether a task's prompts carry images (its module sets VISION; the text tasks' modules leave it out, so
    their cached assets, keyed by their source, stay valid)."""
    return getattr(task, "VISION", False)


def demo_dir(demo_cfg, seed: int) -> str:
    """The cache key is the demo settings, the seed and the task module's source, so a change to the task's data
    or tokenizer rebuilds too."""
    with open(TASKS[demo_cfg.task].__file__, "rb") as source:
        task_code = hashlib.sha256(source.read()).hexdigest()
    settings = {**asdict(demo_cfg), "seed": seed, "v": 1, "task_code": task_code}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return os.path.join(os.path.expanduser(demo_cfg.cache_dir), f"{demo_cfg.task}-{key[:12]}")


def demo_paths(demo_cfg, seed: int) -> tuple[str, list]:
    """(warm-started model dir, [train parquet]) of the demo; they exist after `prepare_demo`."""
    root = demo_dir(demo_cfg, seed)
    return os.path.join(root, "sft"), [os.path.join(root, "data", "train.parquet")]


def prepare_demo(demo_cfg, seed: int, say=print) -> tuple[str, list]:
    """Builds whatever is missing, under a file lock so concurrent processes do not build twice."""
    root = demo_dir(demo_cfg, seed)
    model_dir, files = demo_paths(demo_cfg, seed)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(model_dir, "DONE")):
            return model_dir, files
        say(f"demo: building assets in {root} (once; cached afterwards)")
        task = TASKS[demo_cfg.task]
        write_dataset(task, files[0], demo_cfg.num_prompts, seed)
        base_dir = os.path.join(root, "base")
        build_base_model(task, base_dir, demo_cfg, seed)
        if vision_task(task):  # SFT takes text only: a vision task starts from the random model
            shutil.copytree(base_dir, model_dir, dirs_exist_ok=True)
            open(os.path.join(model_dir, "DONE"), "w").close()
        else:
            warm_start(base_dir, model_dir, os.path.join(root, "data", "sft.parquet"), task, demo_cfg, seed, say)
    return model_dir, files


HELDOUT_PROMPTS = 128
"""Prompts of the demo's held-out split (data/test.parquet), none of them in the training set."""


def heldout_file(demo_cfg, seed: int) -> str:
    """The demo's held-out split, made from another seed with the training prompts taken out; written on first
    use (a cache made before it existed gets it then), under the demo's lock."""
    root = demo_dir(demo_cfg, seed)
    path = os.path.join(root, "data", "test.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(path):
            import pyarrow as pa
            import pyarrow.parquet as pq

            task = TASKS[demo_cfg.task]
            seen = {row_key(row) for row in task.make_rows(demo_cfg.num_prompts, seed)}
            rows = [row for row in task.make_rows(4 * HELDOUT_PROMPTS, seed + 2_000_003)
                    if row_key(row) not in seen][:HELDOUT_PROMPTS]
            pq.write_table(pa.Table.from_pylist(rows), path + ".tmp")
            os.replace(path + ".tmp", path)
    return path


def row_key(row: dict) -> str:
    """What makes two rows the same prompt: the messages, and the images of a vision task (whose text is the same
    for every row)."""
    return str(row["prompt"]) + repr(row.get("images"))


def write_dataset(task, path: str, num_prompts: int, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(task.make_rows(num_prompts, seed)), path)
    pq.write_table(pa.Table.from_pylist(task.sft_rows(num_prompts, seed + 1_000_003)),
                   os.path.join(os.path.dirname(path), "sft.parquet"))


def tokenizer_spec(task):
    """The task's tokenizer settings for learner/tokenizer.py. `task.TOKENIZER_MODEL` is `byte_level` (a character
    tokenizer any text survives) or `word_level` (the sort task's original one, kept so its cached assets and
    measured numbers stay valid: a word-level vocabulary survives Qwen2Tokenizer only for text without whitespace,
    which `check_round_trip` verifies)."""
    from asyncrl.learner.tokenizer import TokenizerSpec

    return TokenizerSpec(model=task.TOKENIZER_MODEL, special_tokens=tuple(task.SPECIAL_TOKENS), eos=task.EOS,
                         added_tokens=tuple(task.ADDED_TOKENS), chat_template=task.CHAT_TEMPLATE)


def train_char_tokenizer(task, corpus: list):
    """A character-level tokenizer trained on the task's text (learner/tokenizer.py::train_tokenizer): every
    character of the corpus is one token, and so is each of the task's special and added tokens."""
    from asyncrl.learner.tokenizer import train_tokenizer

    return train_tokenizer(corpus, tokenizer_spec(task))


def build_base_model(task, out_dir: str, demo_cfg, seed: int) -> None:
    """The demo's random-init model (learner/init_model.py, as `asyncrl init-model` builds one) and tokenizer."""
    from asyncrl.learner.init_model import ModelShape, build_model, padded_vocab, save_model_dir
    from asyncrl.learner.model import build_qwen2_05b
    from asyncrl.learner.tokenizer import check_round_trip

    tokenizer = train_char_tokenizer(task, task.tokenizer_corpus(seed))
    vocab = padded_vocab(len(tokenizer))
    if vision_task(task):
        from asyncrl.learner.init_model import build_vision_model

        model, processor = build_vision_model("qwen2_5_vl", vocab, tokenizer, seed, task.MAX_POSITIONS,
                                              demo_cfg.hidden_size, demo_cfg.num_layers)
        save_model_dir(out_dir, model, tokenizer)
        processor.save_pretrained(out_dir)
        check_round_trip(out_dir, task.tokenizer_corpus(seed))
        return
    if demo_cfg.model_shape == "qwen2-0.5b":
        model = build_qwen2_05b(vocab, tokenizer.eos_token_id, tokenizer.pad_token_id, seed,
                                max_positions=task.MAX_POSITIONS)
    else:
        shape = ModelShape("qwen2", demo_cfg.hidden_size, demo_cfg.num_layers, max_positions=task.MAX_POSITIONS)
        model = build_model(shape, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id, seed)
    save_model_dir(out_dir, model, tokenizer)
    check_round_trip(out_dir, task.tokenizer_corpus(seed)[:20])


def warm_start(base_dir: str, out_dir: str, sft_file: str, task, demo_cfg, seed: int, say) -> None:
    """SFT for a fixed number of steps (steps, not seconds: the same start on every machine)."""
    import torch

    from asyncrl.learner.model import load_model, load_tokenizer
    from asyncrl.learner.sft import run_sft
    from asyncrl.data.sft import read_sft_examples
    from asyncrl.learner.train_step import StepSettings

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(base_dir)
    model = load_model(base_dir)
    examples = read_sft_examples([sft_file], tokenizer)

    def on_step(step, total, loss):
        if step % 10 == 0 or step == total:
            say(f"demo: SFT warm start step {step}/{total}, loss {loss:.3f}")

    # micro-batches of rows of like length: the tool task's transcripts are 60 to 150 tokens, and one padded
    # batch would spend a third of its work on padding
    settings = StepSettings(version=0, max_staleness=0, max_tokens_per_microbatch=SFT_MICROBATCH_TOKENS,
                            chunk_tokens=4096, grad_clip=1.0)
    run_sft(model, examples, demo_cfg.sft_steps, demo_cfg.sft_lr, demo_cfg.sft_batch_size, seed, settings=settings,
            on_step=on_step)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    open(os.path.join(out_dir, "DONE"), "w").close()
