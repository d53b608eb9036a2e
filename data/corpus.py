"""The text a new task uses, read from the user's files, for its tokenizer (`asyncrl init-model`,
learner/init_model.py).

A character tokenizer knows only the characters it was trained on, so the corpus must hold every character the task
will ever tokenize: the prompts, the answers the model should learn to write, and the chat template's own text (the
template is rendered over the corpus's conversations, learner/init_model.py). Three formats, chosen per file by its
name:

- `.parquet`: the rows `asyncrl run` and `asyncrl sft` read. verl rows (`prompt` messages, `reward_model.ground_truth`,
  `extra_info`) give every message's content, the ground truth and every string or number in `extra_info` (an
  `answer` or `solution` there is text the model may be taught to write); chat rows (`messages`, optional `tools`)
  give every message's content.
- `.jsonl`: the same rows, one JSON object a line.
- anything else: plain UTF-8 text, each line (its newline kept) one text.
"""
import json
import os
from dataclasses import dataclass, field


class CorpusError(ValueError):
    """A corpus file that cannot be read; the message names the file and, where it is one, the row."""


@dataclass
class Corpus:
    texts: list[str] = field(default_factory=list)
    """Every text, in file then row order: what the tokenizer is trained on and must give back exactly."""
    sources: list[str] = field(default_factory=list)
    """Where each text came from ("path:row" or "path:line"), for the round-trip check's error."""
    conversations: list[tuple] = field(default_factory=list)
    """(messages, tools) of each row, an assistant turn with its ground truth appended to a verl prompt: rendered
    with the chat template so that the template's text is in the vocabulary too."""
    files: list[str] = field(default_factory=list)


def read_corpus(paths: list[str]) -> Corpus:
    if not paths:
        raise CorpusError("no corpus: give at least one file (--corpus FILE: .parquet, .jsonl or plain text)")
    corpus = Corpus()
    for path in paths:
        if not os.path.isfile(path):
            raise CorpusError(f"corpus file {path!r} does not exist")
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            add_rows(corpus, path, pq.read_table(path).to_pylist())
        elif path.endswith(".jsonl"):
            add_rows(corpus, path, read_jsonl(path))
        else:
            with open(path, encoding="utf-8") as handle:
                try:
                    lines = handle.read().splitlines(keepends=True)
                except UnicodeDecodeError as err:
                    raise CorpusError(f"corpus file {path!r} is not UTF-8 text ({err}); give .parquet or .jsonl "
                                      f"rows, or UTF-8 text") from None
            corpus.texts += lines
            corpus.sources += [f"{path}:line {index + 1}" for index in range(len(lines))]
        corpus.files.append(path)
    if not any(corpus.texts):
        raise CorpusError(f"the corpus {paths} holds no text")
    return corpus


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise CorpusError(f"corpus file {path!r}, line {number}: not JSON ({err})") from None
    return rows


def add_rows(corpus: Corpus, path: str, rows: list) -> None:
    for index, row in enumerate(rows):
        where = f"{path}:row {index}"
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise CorpusError(f"corpus {where}: a row needs a 'prompt' (verl) or 'messages' (chat) column; got "
                              f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
        messages = check_messages(row.get("messages") if "messages" in row else row["prompt"], where)
        texts = [message["content"] for message in messages]
        answers = list(leaves((row.get("reward_model") or {}).get("ground_truth")))
        texts += answers + list(leaves(row.get("extra_info")))
        corpus.texts += texts
        corpus.sources += [where] * len(texts)
        if "messages" not in row and len(answers) == 1:
            messages = [*messages, {"role": "assistant", "content": answers[0]}]
        tools = row.get("tools")
        corpus.conversations.append((messages, json.loads(tools) if isinstance(tools, str) else tools))


def check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise CorpusError(f"corpus {where}: messages must be a list of {{'role': str, 'content': str}}; got "
                          f"{str(messages)[:120]}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def leaves(value):
    """The strings and numbers in a value (a ground truth may be a string, a number, a list or a mapping)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield str(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from leaves(item)
