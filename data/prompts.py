"""Prompts, one `PromptRow` type whether the learner deals a row or a generator walks its own copy: parquet in
verl's row format (or reasoning-gym's generated rows) turned into token ids with the model's chat template, and a
row's encoding for a deal.

Why the encoding lives here and not in buffer/: the buffer is below data/ (it may import only configs), yet it is the
buffer that carries a dealt row from the learner to a generator. So the buffer carries the row as opaque bytes: the
dealer (buffer/dealing.py) keeps the cursor over `EncodedPrompts` (each prompt's id, its encoded row and its data
source) and deals what it was given, and the admit reply hands the generator [deal id, row bytes]. The row's fields
are known in one module, this one: `encode_prompt` runs on the learner when it loads its data (so a row msgpack
cannot carry fails at load time, naming the row), and `decode_prompt` runs on the generator when a deal arrives
(generator/admission.py, and the evaluation rounds' prompts), checking it like any input from the network.
"""
import os
import random
from dataclasses import dataclass
from typing import Iterator

import msgpack
import numpy as np

from asyncrl.buffer.dealing import DealError, EncodedPrompts, prompt_digest


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
    deal_id: str | None = None
    """The learner dealt this row under this id (the group goes back with it: the learner accepts the group only
    under its deal); None when the generator walks its own copy of the data."""
    images: list | None = None
    """A multimodal row's images, encoded (PNG, JPEG or WebP bytes, read and bounded at load: data/images.py), in
    the order of the image-pad tokens in prompt_ids (one each: the engine and the learner widen them)."""


@dataclass
class PromptSet:
    """A dataset read and tokenised: the rows that fit data.max_prompt_tokens, and how many did not."""

    rows: list
    overlong: int
    source: str = ""
    """Which data these are, in words, for every line and metric computed on them: "eval.files: test.parquet",
    "the 10% held-out split of train.parquet" (what `describe_*` below say)."""


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
            row["_dir"] = os.path.dirname(os.path.abspath(path))  # where an image's relative path starts
            rows.append(row)
    return rows


def tokenize_rows(rows: list[dict], tokenizer, max_prompt_tokens: int, max_images: int = 4,
                  max_image_bytes: int = 4 << 20, vision=None) -> tuple[list[PromptRow], int]:
    """Render each prompt with the chat template and tokenize; returns the rows that fit and how many were skipped.
    A row with `images` has its `<image>` placeholders rendered as the model's vision span and its images read
    (data/images.py: at most `max_images`, each at most `max_image_bytes`) and decoded once by `vision` (a
    vision-language model's VisionProcessor, data/vision.py), which also says how long the prompt is once its image
    pads are widened: that length is what must fit. A row whose images cannot be read, or a row with images for a
    model without `vision`, is an error naming it, not a skip."""
    from asyncrl.data.images import ImageError, image_bytes, replace_placeholders

    out, skipped = [], 0
    for row in rows:
        messages, images, widened = row["prompt"], None, 0
        if row.get("images"):
            if vision is None:
                raise DatasetError(f"row {row['_id']} has images, and the model is not a vision-language model "
                                   f"(or the rows are not the learner's to deal: docs/vision.md)")
            try:
                if len(row["images"]) > max_images:
                    raise ImageError(f"{len(row['images'])} images, more than data.max_images={max_images}")
                images = [image_bytes(entry, row.get("_dir", ""), max_image_bytes) for entry in row["images"]]
                messages = replace_placeholders(messages, len(images))
                widened = sum(vision.pads_of(image) - 1 for image in images)
            except ImageError as err:
                raise DatasetError(f"row {row['_id']}: {err}") from None
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids or len(ids) + widened > max_prompt_tokens:
            skipped += 1
            continue
        ground_truth = (row["reward_model"] or {}).get("ground_truth")
        out.append(PromptRow(row["_id"], ids, row["data_source"], ground_truth, row["extra_info"] or {},
                             messages=row["prompt"], images=images))
    if not out:
        raise DatasetError(f"no prompt fits data.max_prompt_tokens={max_prompt_tokens} ({skipped} skipped)")
    return out, skipped


def iterate_prompts(rows: list[PromptRow], shuffle: bool, seed: int) -> Iterator[PromptRow]:
    """Endless epochs over the rows, reshuffled each epoch (a generator walking its own copy of the data)."""
    rng = random.Random(seed)
    epoch = list(rows)
    while True:
        if shuffle:
            rng.shuffle(epoch)
        yield from epoch


HELD_OUT_SALT = "data-val"
"""Salt of data.val_fraction's split (data/split.py), so it is not sft.val_fraction's of the same seed."""


def split_job_rows(data_cfg, seed: int, train_files: list) -> tuple[list, list]:
    """(the rows trained on, the rows held out by data.val_fraction): `train_files`, or reasoning-gym's tasks
    (data.source), generated and split from `seed` (job.seed, the same in every process, so the learner and a
    generator walking its own copy hold out the same rows)."""
    from asyncrl.data.reasoning_gym import reasoning_gym_rows
    from asyncrl.data.split import SplitError, split_held_out

    if data_cfg.source == "reasoning_gym":
        rows = reasoning_gym_rows(data_cfg.reasoning_gym_tasks, data_cfg.reasoning_gym_size, seed)
    else:
        rows = read_rows(train_files)
    try:
        return split_held_out(rows, data_cfg.val_fraction, seed, HELD_OUT_SALT)
    except SplitError as err:
        raise DatasetError(f"data.val_fraction={data_cfg.val_fraction}: {err}") from None


def job_rows(data_cfg, seed: int, train_files: list) -> list[dict]:
    """The job's prompt rows that are trained on, untokenized (data.val_fraction's held-out rows left out)."""
    return split_job_rows(data_cfg, seed, train_files)[0]


def describe_files(key: str, files: list) -> str:
    return f"{key}: {', '.join(os.path.basename(f) for f in files)}"


def describe_split(data_cfg, train_files: list) -> str:
    """The held-out split, named by what it was carved from."""
    origin = (", ".join(os.path.basename(f) for f in train_files) if data_cfg.source == "files"
              else f"reasoning-gym's {', '.join(data_cfg.reasoning_gym_tasks)}")
    return f"the {data_cfg.val_fraction:.0%} held-out split of {origin}"


def tokenize_with_model(raw_rows: list, model_path: str, max_prompt_tokens: int,
                        trust_remote_code: bool = False, source: str = "", data_cfg=None) -> PromptSet:
    """`raw_rows` tokenized with the chat template of the model at `model_path` (and, for a vision-language model,
    its images read with its processor, bounded by `data_cfg`'s image settings)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return PromptSet(*tokenize_rows(raw_rows, tokenizer, max_prompt_tokens,
                                    **image_settings(model_path, data_cfg, trust_remote_code)), source=source)


def image_settings(model_path: str, data_cfg=None, trust_remote_code: bool = False) -> dict:
    """tokenize_rows's image keywords for the model at `model_path`: its VisionProcessor when it is a
    vision-language model (none otherwise: a row with images is then refused), and data_cfg's bounds."""
    from asyncrl.data.vision import is_vision_dir, vision_processor

    settings = {} if data_cfg is None else {"max_images": data_cfg.max_images,
                                            "max_image_bytes": data_cfg.max_image_bytes}
    if is_vision_dir(model_path):
        settings["vision"] = vision_processor(model_path, trust_remote_code,
                                              data_cfg.max_image_pixels if data_cfg is not None else 1 << 22)
    return settings


def load_train_prompts(data_cfg, train_files: list, model_path: str, seed: int,
                       trust_remote_code: bool = False) -> PromptSet | None:
    """What the learner deals (buffer/dealing.py): the job's prompts (`train_files`, resolved by the CLI, or
    reasoning-gym's) less data.val_fraction's held-out rows; None for a job without data (its generators are
    scripted clients that bring their own)."""
    if data_cfg.source != "reasoning_gym" and not train_files:
        return None
    return tokenize_with_model(job_rows(data_cfg, seed, train_files), model_path, data_cfg.max_prompt_tokens,
                               trust_remote_code, data_cfg=data_cfg)


def load_held_out_prompts(data_cfg, train_files: list, model_path: str, seed: int,
                          trust_remote_code: bool = False) -> tuple[PromptSet, int]:
    """(data.val_fraction's held-out rows, tokenized, as the learner's evaluation rounds deal them; how many rows
    are trained on)."""
    train, held = split_job_rows(data_cfg, seed, train_files)
    return tokenize_with_model(held, model_path, data_cfg.max_prompt_tokens, trust_remote_code,
                               source=describe_split(data_cfg, train_files), data_cfg=data_cfg), len(train)


def load_eval_prompts(files: list, model_path: str, max_prompt_tokens: int, trust_remote_code: bool = False,
                      source: str = "") -> PromptSet:
    """The held-out prompts the learner's evaluation rounds deal to the fleet (buffer/eval_rounds.py); `source`
    names them (default: eval.files and their names)."""
    return tokenize_with_model(read_rows(files), model_path, max_prompt_tokens, trust_remote_code,
                               source=source or describe_files("eval.files", files))


# --- a row as a deal carries it --------------------------------------------------------------------------------
MAX_DEALT_IMAGES = 64
"""A dealt row's images, at most (the learner's data.max_images is far below): the deal's size is bounded by the
buffer's message limit; this bounds the count before anything is decoded."""


def encode_prompt(row: PromptRow) -> bytes:
    """A prompt row as the msgpack map a deal carries. Raises DealError for a row msgpack cannot carry (a parquet
    cell of a type it does not know), at load time, naming the row."""
    try:
        fields = {"prompt_id": row.prompt_id, "prompt_ids": np.asarray(row.prompt_ids, "<i4").tobytes(),
                  "data_source": row.data_source, "ground_truth": row.ground_truth,
                  "extra_info": row.extra_info or {}, "messages": row.messages}
        if row.images:
            fields["images"] = list(row.images)
        return msgpack.packb(fields, use_bin_type=True)
    except (TypeError, ValueError) as err:
        raise DealError(f"prompt {row.prompt_id}: its row cannot be dealt ({err})") from None


def encode_prompts(rows: list) -> EncodedPrompts:
    """The rows as the dealer and the evaluation rounds hold them."""
    return EncodedPrompts(prompt_ids=[row.prompt_id for row in rows], rows=[encode_prompt(row) for row in rows],
                          data_sources=[row.data_source for row in rows],
                          prompt_digests=[prompt_digest(row.prompt_ids) for row in rows])


def decode_prompt(deal_id, blob) -> PromptRow:
    """The generator's side of `encode_prompt`: the row dealt under `deal_id`; raises DealError for anything that
    is not such a row."""
    if not isinstance(deal_id, str) or not isinstance(blob, bytes):
        raise DealError("a deal must be [deal id, row bytes]")
    try:
        row = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except Exception as err:
        raise DealError(f"deal {deal_id}: row is not msgpack ({type(err).__name__})") from None
    if not isinstance(row, dict):
        raise DealError(f"deal {deal_id}: row is not a map")
    ids, extra, messages = row.get("prompt_ids"), row.get("extra_info"), row.get("messages")
    if (not isinstance(row.get("prompt_id"), str) or not isinstance(row.get("data_source"), str)
            or not isinstance(ids, bytes) or not ids or len(ids) % 4 or not isinstance(extra, dict)
            or not (messages is None or isinstance(messages, list))):
        raise DealError(f"deal {deal_id}: row lacks prompt_id, prompt_ids, data_source, extra_info or messages")
    images = row.get("images")
    if images is not None and (not isinstance(images, list) or not 0 < len(images) <= MAX_DEALT_IMAGES
                               or not all(isinstance(image, bytes) and image for image in images)):
        raise DealError(f"deal {deal_id}: images must be a list of 1 to {MAX_DEALT_IMAGES} non-empty byte strings")
    return PromptRow(row["prompt_id"], np.frombuffer(ids, "<i4").tolist(), row["data_source"],
                     row.get("ground_truth"), extra, messages, deal_id=deal_id, images=images)
