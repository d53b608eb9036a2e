"""Prompt datasets: parquet in verl's row format, turned into token ids with the model's chat template."""
import os
import random
from dataclasses import dataclass
from typing import Iterator


class DatasetError(ValueError):
    """A dataset file is missing or its rows do not have verl's columns."""


@dataclass
class PromptRow:
    prompt_id: str
    prompt_ids: list
    data_source: str
    ground_truth: object
    extra_info: dict
    messages: list | None = None
    """The row's prompt as chat messages: an episode renders its opening from them (with the tools' schemas)."""


REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")


def read_rows(paths: list) -> list[dict]:
    import pyarrow.parquet as pq

    if not paths:
        raise DatasetError("data.train_files is empty: give at least one parquet file")
    rows = []
    for path in paths:
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            raise DatasetError(f"data.train_files: {path!r} does not exist")
        table = pq.read_table(path)
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise DatasetError(f"{path}: missing verl columns {missing} (has {table.column_names})")
        for index, row in enumerate(table.to_pylist()):
            row.setdefault("extra_info", None)
            row["_id"] = f"{os.path.basename(path)}:{index}"
            rows.append(row)
    return rows


def tokenize_rows(rows: list[dict], tokenizer, max_prompt_tokens: int) -> tuple[list[PromptRow], int]:
    """Render each prompt with the chat template and tokenize; returns the rows that fit and how many were skipped."""
    out, skipped = [], 0
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids or len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        ground_truth = (row["reward_model"] or {}).get("ground_truth")
        out.append(PromptRow(row["_id"], ids, row["data_source"], ground_truth, row["extra_info"] or {},
                             messages=row["prompt"]))
    if not out:
        raise DatasetError(f"no prompt fits data.max_prompt_tokens={max_prompt_tokens} ({skipped} skipped)")
    return out, skipped


def iterate_prompts(rows: list[PromptRow], shuffle: bool, seed: int) -> Iterator[PromptRow]:
    """Endless epochs over the rows, reshuffled each epoch."""
    rng = random.Random(seed)
    epoch = list(rows)
    while True:
        if shuffle:
            rng.shuffle(epoch)
        yield from epoch


def job_rows(data_cfg, seed: int, train_files: list) -> list[dict]:
    """The job's prompt rows, untokenized: `data.train_files`, or reasoning-gym's tasks (data.source), generated
    from `seed` (job.seed, the same in every process)."""
    from asyncrl.data.reasoning_gym import reasoning_gym_rows

    if data_cfg.source == "reasoning_gym":
        return reasoning_gym_rows(data_cfg.reasoning_gym_tasks, data_cfg.reasoning_gym_size, seed)
    return read_rows(train_files)


def load_prompt_rows(raw_rows: list, model_path: str, max_prompt_tokens: int, trust_remote_code: bool = False):
    """`raw_rows` tokenized with the model's chat template: (rows, how many were longer than max_prompt_tokens).
    What the learner deals (buffer/dealer.py) and evaluates during training (buffer/eval_rounds.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return tokenize_rows(raw_rows, tokenizer, max_prompt_tokens)
