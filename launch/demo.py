"""Demo assets, built on first use and cached: a character tokenizer trained with `tokenizers`, a tiny Qwen2, the
task's parquet dataset, and the SFT warm start. The cache key is the demo settings, so changing them rebuilds.
"""
import fcntl
import hashlib
import json
import logging
import os
import sys
from dataclasses import asdict

from asyncrl.generator.tasks import sort_digits

log = logging.getLogger(__name__)
TASKS = {"sort_digits": sort_digits}
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]


def demo_dir(demo_cfg, seed: int) -> str:
    key = hashlib.sha256(json.dumps({**asdict(demo_cfg), "seed": seed, "v": 1}, sort_keys=True).encode()).hexdigest()
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
        warm_start(base_dir, model_dir, os.path.join(root, "data", "sft.parquet"), task, demo_cfg, seed, say)
    return model_dir, files


def write_dataset(task, path: str, num_prompts: int, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(task.make_rows(num_prompts, seed)), path)
    pq.write_table(pa.Table.from_pylist(task.make_rows(num_prompts, seed + 1_000_003)),
                   os.path.join(os.path.dirname(path), "sft.parquet"))


def train_char_tokenizer(corpus: list):
    """A character-level tokenizer trained on the task's text: every character of the corpus is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    return fast


def build_base_model(task, out_dir: str, demo_cfg, seed: int) -> None:
    from asyncrl.learner.model import build_qwen2

    rows = task.make_rows(2000, seed)
    corpus = [r["prompt"][0]["content"] + r["reward_model"]["ground_truth"] for r in rows] + [task.ALPHABET]
    tokenizer = train_char_tokenizer(corpus)
    vocab = ((len(tokenizer) + 15) // 16) * 16  # padded; ids >= len(tokenizer) are never sampled after SFT
    model = build_qwen2(vocab, demo_cfg.hidden_size, demo_cfg.num_layers, tokenizer.eos_token_id,
                        tokenizer.pad_token_id, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def warm_start(base_dir: str, out_dir: str, sft_file: str, task, demo_cfg, seed: int, say) -> None:
    """SFT for a fixed number of steps (steps, not seconds: the same start on every machine)."""
    import torch

    from asyncrl.learner.model import load_model, load_tokenizer
    from asyncrl.learner.sft import run_sft
    from asyncrl.learner.sft_data import read_sft_examples

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(base_dir)
    model = load_model(base_dir)
    examples = read_sft_examples([sft_file], tokenizer)

    def on_step(step, total, loss):
        if step % 10 == 0 or step == total:
            say(f"demo: SFT warm start step {step}/{total}, loss {loss:.3f}")

    run_sft(model, examples, demo_cfg.sft_steps, demo_cfg.sft_lr, demo_cfg.sft_batch_size, seed, on_step=on_step)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    open(os.path.join(out_dir, "DONE"), "w").close()


def say_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
