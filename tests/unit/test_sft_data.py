"""SFT data reader: loss masks from prefix renderings, on two local tokenizers (no hub).

- `char`: the demo's character tokenizer, whose template only concatenates contents (no EOS of its own).
- `chatml`: a character-level WordLevel tokenizer with <|im_start|>/<|im_end|> special tokens and a ChatML
  template; its EOS is <|im_end|>, so the template closes every assistant turn with EOS.
"""
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.data.sft import SFTDataError, SFTExample, read_sft_examples

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?'\n"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Sort 312"},
    {"role": "assistant", "content": "123"},
]


def build_chatml_tokenizer(eos_token: str = "<|im_end|>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(set(CHARS)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token=eos_token,
                                   pad_token="<|endoftext|>", additional_special_tokens=specials[1:3])
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="module")
def chatml():
    return build_chatml_tokenizer()


@pytest.fixture(scope="module")
def char():
    from asyncrl.generator.tasks import sort_digits
    from asyncrl.launch.demo import train_char_tokenizer

    return train_char_tokenizer(sort_digits, [CHARS])


def write_rows(tmp_path, rows: list, name: str = "data.parquet") -> str:
    path = str(tmp_path / name)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def trained_spans(tokenizer, example: SFTExample) -> list[str]:
    """Decoded text of each maximal run of trained tokens."""
    spans, run = [], []
    for token, trained in zip(example.input_ids + [None], example.loss_mask + [0]):
        if trained:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return spans


def untrained_text(tokenizer, example: SFTExample) -> str:
    ids = [t for t, trained in zip(example.input_ids, example.loss_mask) if not trained]
    return tokenizer.decode(ids, skip_special_tokens=False)


# --- chat format ---------------------------------------------------------------------------------------------


def test_chatml_mask_covers_assistant_content_and_end_of_turn_only(tmp_path, chatml):
    path = write_rows(tmp_path, [{"messages": CONVERSATION}])
    [example] = read_sft_examples([path], chatml)
    assert len(example.input_ids) == len(example.loss_mask)
    assert example.source == f"{path}:0"
    assert trained_spans(chatml, example) == ["Hello there<|im_end|>\n", "123<|im_end|>\n"]
    # the headers, system and user turns are context; no EOS is appended (the template ends with <|im_end|>)
    assert untrained_text(chatml, example) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                               "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                                               "<|im_start|>user\nSort 312<|im_end|>\n<|im_start|>assistant\n")
    full = chatml.apply_chat_template(CONVERSATION, tokenize=False)
    assert chatml.decode(example.input_ids, skip_special_tokens=False) == full


def test_eos_is_appended_when_the_template_does_not_end_turns_with_it(tmp_path):
    tokenizer = build_chatml_tokenizer(eos_token="<|endoftext|>")
    [example] = read_sft_examples([write_rows(tmp_path, [{"messages": CONVERSATION[1:3]}])], tokenizer)
    assert example.input_ids[-1] == tokenizer.eos_token_id and example.loss_mask[-1] == 1
    assert trained_spans(tokenizer, example) == ["Hello there<|im_end|>\n<|endoftext|>"]


def test_char_template_trains_each_assistant_turn_and_appends_eos(tmp_path, char):
    [example] = read_sft_examples([write_rows(tmp_path, [{"messages": CONVERSATION}])], char)
    assert trained_spans(char, example) == ["Hello there", "123<eos>"]
    assert untrained_text(char, example) == "Be brief.HiSort 312"


def test_messages_after_the_last_assistant_turn_are_dropped(tmp_path, chatml):
    rows = [{"messages": CONVERSATION[:3] + [{"role": "user", "content": "thanks"}]}]
    [example] = read_sft_examples([write_rows(tmp_path, rows)], chatml)
    assert "thanks" not in chatml.decode(example.input_ids)
    assert trained_spans(chatml, example) == ["Hello there<|im_end|>\n"]


def test_tool_turns_are_context(tmp_path, chatml):
    messages = [{"role": "user", "content": "Add 1 2"}, {"role": "assistant", "content": "call add"},
                {"role": "tool", "content": "3"}, {"role": "assistant", "content": "It is 3"}]
    [example] = read_sft_examples([write_rows(tmp_path, [{"messages": messages}])], chatml)
    assert trained_spans(chatml, example) == ["call add<|im_end|>\n", "It is 3<|im_end|>\n"]


def test_tools_column_renders_the_tools_the_generator_offers(tmp_path):
    """The tool demo's transcripts: SFT renders the same opening, tool list included, as the episode runner."""
    import json

    from asyncrl.generator.agents.chat_render import ChatAppender
    from asyncrl.generator.tasks import add_numbers
    from asyncrl.launch.demo import train_char_tokenizer

    tokenizer = train_char_tokenizer(add_numbers, add_numbers.tokenizer_corpus(0))
    rows = add_numbers.sft_rows(2, seed=3, tool_fraction=1.0)
    [example, _] = read_sft_examples([write_rows(tmp_path, rows)], tokenizer)
    messages = rows[0]["messages"]
    a_plus_b = messages[0]["content"][4:-1]
    assert trained_spans(tokenizer, example) == [add_numbers.call_text(a_plus_b) + "<|im_end|>\n",
                                                 messages[3]["content"] + "<|im_end|>\n"]
    opening = ChatAppender(tokenizer, tools=add_numbers.tools()).prompt_ids(messages[:1])
    assert example.input_ids[:len(opening)] == opening and example.loss_mask[len(opening)] == 1
    assert tokenizer.decode(opening).startswith("<|im_start|>system\ntools: calculator<|im_end|>\n")
    assert tokenizer.decode(opening, skip_special_tokens=True).startswith("system\ntools: calculator\n")
    assert json.loads(rows[0]["tools"]) == add_numbers.tools()


@pytest.mark.parametrize("tools, message", [("{not json", "not valid JSON"), ('{"a": 1}', "list of OpenAI tool"),
                                            ("[1, 2]", "list of OpenAI tool")])
def test_bad_tools_column_names_the_row(tmp_path, chatml, tools, message):
    path = write_rows(tmp_path, [{"messages": CONVERSATION[1:3], "tools": tools}])
    with pytest.raises(SFTDataError, match=f"row 0: .*{message}"):
        read_sft_examples([path], chatml)


def test_rows_of_several_files_keep_file_then_row_order(tmp_path, chatml):
    first = write_rows(tmp_path, [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION[3:5]}], "a.parquet")
    second = write_rows(tmp_path, [{"messages": CONVERSATION}], "b.parquet")
    examples = read_sft_examples([first, second], chatml)
    assert [e.source for e in examples] == [f"{first}:0", f"{first}:1", f"{second}:0"]


def test_template_that_is_not_prefix_stable_is_rejected(tmp_path):
    from asyncrl.generator.tasks import sort_digits
    from asyncrl.launch.demo import train_char_tokenizer

    tokenizer = train_char_tokenizer(sort_digits, [CHARS])
    # appends the message count: a prefix of the conversation renders a different suffix
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    path = write_rows(tmp_path, [{"messages": CONVERSATION[1:3]}])
    with pytest.raises(SFTDataError, match="not prefix-stable") as error:
        read_sft_examples([path], tokenizer)
    assert f"{path}, row 0" in str(error.value)


def test_tokenizer_without_chat_template_is_rejected(tmp_path):
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = None
    path = write_rows(tmp_path, [{"messages": CONVERSATION}])
    with pytest.raises(SFTDataError, match="tokenizer has none") as error:
        read_sft_examples([path], tokenizer)
    assert path in str(error.value)


# --- verl format ---------------------------------------------------------------------------------------------


def test_verl_rows_train_ground_truth_and_eos_only(tmp_path, chatml):
    rows = [{"prompt": [{"role": "user", "content": "Sort 312"}], "reward_model": {"ground_truth": "123"}}]
    [example] = read_sft_examples([write_rows(tmp_path, rows)], chatml)
    assert trained_spans(chatml, example) == ["123<|im_end|>"]
    assert untrained_text(chatml, example) == "<|im_start|>user\nSort 312<|im_end|>\n<|im_start|>assistant\n"


def test_verl_rows_train_on_the_ground_truth_and_eos(tmp_path, char):
    rows = [{"prompt": [{"role": "user", "content": "abc"}], "reward_model": {"ground_truth": "cba"}},
            {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "42"}}]
    path = write_rows(tmp_path, rows)
    for example, row in zip(read_sft_examples([path], char), rows):
        text = char.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        prompt = char(text, add_special_tokens=False)["input_ids"]
        target = char(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [char.eos_token_id]
        assert example.input_ids == prompt + target
        assert example.loss_mask == [0] * len(prompt) + [1] * len(target)


def test_verl_row_without_ground_truth_names_file_and_row(tmp_path, chatml):
    rows = [{"prompt": [{"role": "user", "content": "a"}], "reward_model": {"ground_truth": "b"}},
            {"prompt": [{"role": "user", "content": "a"}], "reward_model": {"ground_truth": None}}]
    path = write_rows(tmp_path, rows)
    with pytest.raises(SFTDataError, match="ground_truth") as error:
        read_sft_examples([path], chatml)
    assert f"{path}, row 1" in str(error.value)


# --- validation ----------------------------------------------------------------------------------------------


def test_missing_file_is_named(tmp_path, chatml):
    path = str(tmp_path / "nope.parquet")
    with pytest.raises(SFTDataError, match="does not exist") as error:
        read_sft_examples([path], chatml)
    assert path in str(error.value)


def test_file_with_unknown_columns_names_its_columns(tmp_path, chatml):
    path = write_rows(tmp_path, [{"text": "hello", "label": 1}])
    with pytest.raises(SFTDataError, match="neither") as error:
        read_sft_examples([path], chatml)
    assert path in str(error.value) and "'text'" in str(error.value) and "'label'" in str(error.value)


GOOD = {"messages": CONVERSATION[1:3]}
BAD_ROWS = {
    "empty": ([], "no messages"),
    "no_role": ([{"content": "Hi"}, {"role": "assistant", "content": "Yo"}], "message 0 has no role"),
    "no_content": ([{"role": "user", "content": "Hi"}, {"role": "assistant"}], "message 1 has no content"),
    "bad_role": ([{"role": "bot", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], "role 'bot'"),
    "no_assistant": ([{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}], "no assistant turn"),
    "assistant_first": ([{"role": "assistant", "content": "Yo"}], "starts with an assistant turn"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_invalid_conversation_names_file_and_row(tmp_path, chatml, case):
    messages, expected = BAD_ROWS[case]
    # all keys on every message so the parquet schema is the same; missing ones are written as null
    messages = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
    path = write_rows(tmp_path, [GOOD, GOOD, {"messages": messages}])
    with pytest.raises(SFTDataError, match=expected) as error:
        read_sft_examples([path], chatml)
    assert f"{path}, row 2" in str(error.value)


# --- max_length ----------------------------------------------------------------------------------------------


@pytest.fixture
def long_and_short(tmp_path):
    """A file whose row 0 is long ("Hi" + a 40-char reply) and row 1 short; returns (path, max_length)."""
    long = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a" * 40}]
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok"}]
    return write_rows(tmp_path, [{"messages": long}, {"messages": short}]), 30


def test_too_long_example_raises_by_default(long_and_short, chatml):
    path, max_length = long_and_short
    with pytest.raises(SFTDataError, match="max_length=30") as error:
        read_sft_examples([path], chatml, max_length=max_length)
    assert f"{path}, row 0" in str(error.value)


def test_too_long_example_is_dropped_and_counted(long_and_short, chatml, caplog):
    path, max_length = long_and_short
    with caplog.at_level(logging.WARNING, logger="asyncrl.data.sft"):
        examples = read_sft_examples([path], chatml, max_length=max_length, truncation="drop")
    assert [e.source for e in examples] == [f"{path}:1"]
    assert "dropped 1 of 2" in caplog.text


def test_too_long_example_is_cut_on_the_right(long_and_short, chatml):
    path, max_length = long_and_short
    full = read_sft_examples([path], chatml)
    cut = read_sft_examples([path], chatml, max_length=max_length, truncation="right")
    assert len(cut[0].input_ids) == len(cut[0].loss_mask) == max_length
    assert cut[0].input_ids == full[0].input_ids[:max_length]
    assert cut[0].loss_mask == full[0].loss_mask[:max_length]
    assert cut[1] == full[1]


def test_cut_that_leaves_nothing_trained_is_dropped(long_and_short, chatml):
    path, _ = long_and_short
    # both rows are longer than 20 tokens, and their first 21 are "<|im_start|>user\nHi<|im_end|>\n" + header
    examples = read_sft_examples([path], chatml, max_length=20, truncation="right")
    assert examples == []


@pytest.mark.parametrize("kwargs", [{"truncation": "left"}, {"max_length": 0}])
def test_bad_truncation_settings_raise(tmp_path, chatml, kwargs):
    path = write_rows(tmp_path, [GOOD])
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        read_sft_examples([path], chatml, **kwargs)


def test_rows_with_images_are_refused_not_trained_as_text(tmp_path, chatml):
    path = write_rows(tmp_path, [{"messages": CONVERSATION, "images": [b"\x89PNG"]}])
    with pytest.raises(SFTDataError, match="has images: SFT takes text only"):
        read_sft_examples([path], chatml)
    [example] = read_sft_examples([write_rows(tmp_path, [{"messages": CONVERSATION, "images": []}])], chatml)
    assert example.input_ids
