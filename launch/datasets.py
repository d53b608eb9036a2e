"""`asyncrl data gsm8k|math --input FILE --out DIR`: a local copy of a public dataset (jsonl or parquet, in the
dataset's own columns) turned into verl-format parquet (prompt, data_source, ability, reward_model, extra_info), the
rows the generators read and the built-in scorers grade (generator/rewards/builtin/). There is no hub here: the
user brings the file.

- gsm8k: columns `question`, `answer` (the worked solution ending in "#### n"); data_source "openai/gsm8k", ground
  truth n, and verl's instruction to put the final answer after "####".
- math: columns `problem` and `solution` (the worked solution with a \\boxed{} answer) or `answer` (MATH-500);
  data_source "DigitalLearningGmbH/MATH-lighteval" (or `--data-source`), ground truth the boxed answer, and
  verl's instruction to put the final answer in \\boxed{}.
A row whose answer cannot be found is skipped and counted, never written with a wrong ground truth.
"""
import json
import os

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DATASETS = ("gsm8k", "math")


class DataPrepError(ValueError):
    """The input cannot be read or has none of the dataset's columns."""


def read_records(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise DataPrepError(f"{path} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    records = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataPrepError(f"{path}:{number}: not a JSON line ({err.msg})") from None
    return records


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    opening = text.find("{", start)
    if opening < 0:
        return None
    depth = 0
    for index in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[opening + 1:index].strip() or None
    return None


def gsm8k_row(record: dict, index: int, split: str) -> dict | None:
    from asyncrl.generator.rewards.builtin.gsm8k import extract

    question, answer = record.get("question"), record.get("answer")
    truth = extract(answer) if isinstance(answer, str) else None
    if not isinstance(question, str) or truth is None:
        return None
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "question": question, "answer": answer}}


def math_row(record: dict, index: int, split: str, data_source: str) -> dict | None:
    problem = record.get("problem")
    answer = record.get("answer")
    truth = str(answer).strip() if answer not in (None, "") else (
        last_boxed(record["solution"]) if isinstance(record.get("solution"), str) else None)
    if not isinstance(problem, str) or not truth:
        return None
    extra = {"split": split, "index": index}
    extra.update({key: str(record[key]) for key in ("level", "type", "subject") if record.get(key) is not None})
    return {"data_source": data_source,
            "prompt": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra}


def convert(dataset: str, input_path: str, out_dir: str, split: str = "train",
            data_source: str = "DigitalLearningGmbH/MATH-lighteval") -> tuple[str, int, int]:
    """Write `out_dir/{split}.parquet`; returns (its path, rows written, rows skipped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if dataset not in DATASETS:
        raise DataPrepError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    records = read_records(input_path)
    wanted = ("question", "answer") if dataset == "gsm8k" else ("problem",)
    if records and not any(all(key in record for key in wanted) for record in records[:100]):
        raise DataPrepError(f"{input_path}: no row has the {dataset} columns {list(wanted)} (the first has "
                            f"{sorted(records[0])})")
    rows = [gsm8k_row(r, i, split) if dataset == "gsm8k" else math_row(r, i, split, data_source)
            for i, r in enumerate(records)]
    kept = [row for row in rows if row is not None]
    if not kept:
        raise DataPrepError(f"{input_path}: none of its {len(records)} rows has a usable answer")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{split}.parquet")
    pq.write_table(pa.Table.from_pylist(kept), path)
    return path, len(kept), len(rows) - len(kept)
