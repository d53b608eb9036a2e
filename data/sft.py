"""SFT data: parquet rows -> token ids with a loss mask on what the model should learn to say.

Two row formats, detected per file from its columns:

- chat: a `messages` column, a list of {"role", "content"} dicts, and optionally a `tools` column: the OpenAI
  tool schemas the conversation offered (a list, or that list as a JSON string), passed to the chat template as
  the generator passes them, so a model learns tool calls on the prompts it will see in RL. The whole
  conversation is rendered with the tokenizer's chat template; every assistant turn is trained, every other turn
  is context.
- verl RL: a `prompt` column (chat messages) and `reward_model.ground_truth`. The prompt is rendered with the
  generation prompt, the target is the ground truth followed by EOS, and only the target is trained.

Masks never parse the rendered text. For assistant turn i we render messages[:i] with the generation prompt
(where the turn's content starts) and messages[:i+1] (where the turn ends, end-of-turn tokens included), and
both renderings must be token prefixes of the full conversation. That works for any template that renders
a conversation the same way whatever follows it; templates that do not (e.g. ones that rewrite earlier turns)
are rejected rather than trained with a wrong mask.
"""
import json
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
TRUNCATIONS = ("error", "drop", "right")


@dataclass
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]
    """Same length as input_ids; 1 where the token is trained (assistant content and its end-of-turn tokens)."""
    source: str
    """Where the row came from, as "path:row", for error messages."""


class SFTDataError(ValueError):
    """A data file or row that cannot be turned into an SFT example; the message names the file and row."""


def read_sft_examples(paths: list[str], tokenizer, max_length: int | None = None,
                      truncation: str = "error") -> list[SFTExample]:
    """Reads every row of every parquet file into an SFTExample, in file then row order.

    Chat rows: the loss mask covers each assistant turn from the end of the template's assistant header to the
    start of the next message, so the template's end-of-turn tokens (e.g. ChatML's "<|im_end|>\\n") are trained
    and the header itself ("<|im_start|>assistant\\n") is not. If the last assistant turn contains no
    `tokenizer.eos_token_id` (a template that only concatenates contents, or one whose end-of-turn token is not
    the tokenizer's EOS), EOS is appended and trained so the model learns to stop. Messages after the last
    assistant turn are dropped: they carry no loss. A conversation may not start with an assistant turn,
    because transformers cannot render the empty conversation that precedes it.

    max_length (tokens) applies to the finished example: `truncation="error"` raises, `"drop"` skips the
    example and logs how many were skipped, `"right"` keeps the first max_length tokens (an example left with
    no trained token is dropped and counted).
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 tokens, got {max_length}")
    examples, dropped = [], 0
    for path in paths:
        for example in read_file(path, tokenizer):
            if max_length is not None and len(example.input_ids) > max_length:
                example = truncate_example(example, max_length, truncation)
                if example is None:
                    dropped += 1
                    continue
            examples.append(example)
    if dropped:
        log.warning("SFT data: dropped %d of %d examples longer than max_length=%d tokens (truncation=%r)",
                    dropped, len(examples) + dropped, max_length, truncation)
    return examples


def truncate_example(example: SFTExample, max_length: int, truncation: str) -> SFTExample | None:
    """The example cut to max_length, or None when it should be dropped."""
    if truncation == "error":
        path, row = example.source.rsplit(":", 1)
        raise SFTDataError(f"SFT data {path}, row {row}: {len(example.input_ids)} tokens is longer than "
                           f"max_length={max_length} (set truncation='drop' or 'right' to allow this)")
    if truncation == "drop":
        return None
    loss_mask = example.loss_mask[:max_length]
    if not any(loss_mask):
        return None
    return SFTExample(example.input_ids[:max_length], loss_mask, example.source)


def read_file(path: str, tokenizer) -> list[SFTExample]:
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise SFTDataError(f"SFT data file {path!r} does not exist")
    table = pq.read_table(path)
    columns = table.column_names
    if "messages" in columns:
        build = build_chat_example
    elif "prompt" in columns and "reward_model" in columns:
        build = build_verl_example
    else:
        raise SFTDataError(f"SFT data file {path!r} has neither a 'messages' column (chat format) nor "
                           f"'prompt' + 'reward_model' columns (verl format); its columns are {columns}")
    if not getattr(tokenizer, "chat_template", None):
        raise SFTDataError(f"SFT data file {path!r} needs a chat template, but the tokenizer has none")
    if "images" in columns and any(table.column("images").to_pylist()):
        raise SFTDataError(f"SFT data file {path!r} has images: SFT takes text only (docs/vision.md), and training "
                           f"on the text with its <image> placeholders would be training on something else")
    return [build(row, tokenizer, f"{path}:{index}", f"SFT data {path}, row {index}")
            for index, row in enumerate(table.to_pylist())]


def build_chat_example(row: dict, tokenizer, source: str, where: str) -> SFTExample:
    messages = check_messages(row["messages"], where)
    tools = check_tools(row.get("tools"), where)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise SFTDataError(f"{where}: the conversation has no assistant turn, so nothing would be trained")
    if turns[0] == 0:
        raise SFTDataError(f"{where}: the conversation starts with an assistant turn; the template's assistant "
                           f"header cannot be found without a message before it")
    messages = messages[: turns[-1] + 1]
    input_ids = render_ids(tokenizer, messages, False, where, tools)
    loss_mask = [0] * len(input_ids)
    for i in turns:
        start, end = assistant_span(tokenizer, messages, i, input_ids, where, tools)
        loss_mask[start:end] = [1] * (end - start)
    if tokenizer.eos_token_id not in input_ids[start:end]:  # [start, end) is the last turn, which ends the sequence
        append_eos(tokenizer, input_ids, loss_mask, where)
    return SFTExample(input_ids, loss_mask, source)


def build_verl_example(row: dict, tokenizer, source: str, where: str) -> SFTExample:
    truth = (row.get("reward_model") or {}).get("ground_truth")
    if truth is None:
        raise SFTDataError(f"{where}: no reward_model.ground_truth to use as the SFT target")
    prompt = render_ids(tokenizer, check_messages(row["prompt"], where), True, where)
    target = tokenizer(str(truth), add_special_tokens=False)["input_ids"]
    input_ids, loss_mask = prompt + target, [0] * len(prompt) + [1] * len(target)
    append_eos(tokenizer, input_ids, loss_mask, where)
    return SFTExample(input_ids, loss_mask, source)


def assistant_span(tokenizer, messages: list[dict], i: int, full_ids: list[int], where: str,
                   tools: list | None = None) -> tuple[int, int]:
    """[start, end) token positions of assistant turn i: after its generation prompt, through its end-of-turn."""
    start = len(render_prefix(tokenizer, messages[:i], True, full_ids, where, tools))
    end = len(render_prefix(tokenizer, messages[: i + 1], False, full_ids, where, tools))
    if end < start:
        raise SFTDataError(f"{where}: the chat template is not prefix-stable: assistant turn {i} renders "
                           f"shorter than the generation prompt before it")
    return start, end


def check_messages(messages, where: str) -> list[dict]:
    """The messages with None-valued keys removed (parquet fills keys that other rows have with None, and
    templates test `is defined`); raises on anything a template could not render meaningfully."""
    if not messages:
        raise SFTDataError(f"{where}: the conversation has no messages")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SFTDataError(f"{where}: message {i} is a {type(message).__name__}, not a dict with role/content")
        role, content = message.get("role"), message.get("content")
        if role is None or content is None:
            missing = " and ".join(k for k, v in (("role", role), ("content", content)) if v is None)
            raise SFTDataError(f"{where}: message {i} has no {missing}")
        if role not in ROLES:
            raise SFTDataError(f"{where}: message {i} has role {role!r}; roles must be one of {ROLES}")
        if not isinstance(content, str):
            raise SFTDataError(f"{where}: message {i} content is a {type(content).__name__}, not a string")
        cleaned.append({k: v for k, v in message.items() if v is not None})
    return cleaned


def check_tools(tools, where: str) -> list | None:
    """The row's tool schemas as a list of dicts (None when it offers none); a JSON string is parsed."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as error:
            raise SFTDataError(f"{where}: the tools column is not valid JSON: {error}") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise SFTDataError(f"{where}: tools must be a list of OpenAI tool schemas (dicts), or that list as JSON")
    return tools or None


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str,
               tools: list | None = None) -> list[int]:
    # Render to text, then tokenize without special tokens: templates that write BOS themselves would
    # otherwise get a second one, and this matches how the generator tokenizes prompts.
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as error:  # jinja raises TemplateError for conversations a template refuses
        raise SFTDataError(f"{where}: the chat template failed to render {len(messages)} messages: {error}") from error
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_prefix(tokenizer, messages: list[dict], add_generation_prompt: bool, full_ids: list[int],
                  where: str, tools: list | None = None) -> list[int]:
    """The rendering of the first messages, which must be a token prefix of the full conversation's."""
    ids = render_ids(tokenizer, messages, add_generation_prompt, where, tools)
    if full_ids[: len(ids)] != ids:
        kind = "with" if add_generation_prompt else "without"
        raise SFTDataError(f"{where}: the chat template is not prefix-stable: rendering the first {len(messages)} "
                           f"messages ({kind} the generation prompt) is not a token prefix of rendering the whole "
                           f"conversation, so the assistant turns cannot be masked from prefix renderings")
    return ids


def append_eos(tokenizer, input_ids: list[int], loss_mask: list[int], where: str) -> None:
    if tokenizer.eos_token_id is None:
        raise SFTDataError(f"{where}: the target needs an EOS token to end it, but the tokenizer has no eos_token")
    input_ids.append(tokenizer.eos_token_id)
    loss_mask.append(1)
