"""A new task's tokenizer and model (learner/tokenizer.py, learner/init_model.py, data/corpus.py): what every part
loads back from the directory (AutoTokenizer, as learner/model.py::load_tokenizer) gives the text back exactly,
the special tokens and the chat template are as a chat model needs them, and the failures say what to do."""
import json
import unicodedata

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from asyncrl.data.corpus import CorpusError, read_corpus
from asyncrl.learner.init_model import FAMILIES, InitModelError, ModelShape, build_model, init_model, save_model_dir
from asyncrl.learner.model import build_qwen2, load_tokenizer
from asyncrl.learner.tokenizer import TokenizerRoundTripError, TokenizerSpec, check_round_trip, train_tokenizer

TEXTS = ["Grüße aus Köln, naïve café: 3 × 4 = 12 ∑ 日本語 🙂", "  two leading spaces\nand a newline\n",
         "\ttab\r\nwindows line\n\n\nthree newlines", "{\"json\": [1, 2.5, null]} <b>tags</b> back\\slash"]


def saved(tmp_path, tokenizer, family="qwen2", name="model"):
    """The tokenizer in a model directory of `family`, as init-model writes it."""
    model = build_model(ModelShape(family, 32, 1, max_positions=64), 16 * (len(tokenizer) // 16 + 1),
                        tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
    save_model_dir(str(tmp_path / name), model, tokenizer)
    return str(tmp_path / name)


@pytest.mark.parametrize("family", FAMILIES)
def test_any_text_of_the_corpus_round_trips_through_autotokenizer_one_token_per_ascii_character(tmp_path, family):
    model_dir = saved(tmp_path, train_tokenizer(TEXTS, TokenizerSpec()), family)
    check_round_trip(model_dir, TEXTS)  # raises on the first text that does not come back
    loaded = load_tokenizer(model_dir)
    assert len(loaded("abc  t\n", add_special_tokens=False)["input_ids"]) == 7


def test_special_tokens_are_single_ids_and_the_chat_template_renders_chatml(tmp_path):
    loaded = load_tokenizer(saved(tmp_path, train_tokenizer(TEXTS + ["user assistant system?"], TokenizerSpec())))
    assert [loaded.pad_token, loaded.unk_token, loaded.eos_token] == ["<pad>", "<unk>", "<|im_end|>"]
    assert loaded.convert_tokens_to_ids(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2, 3]
    messages = [{"role": "user", "content": "café?"}, {"role": "assistant", "content": "ja\n42"}]
    text = loaded.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\ncafé?<|im_end|>\n<|im_start|>assistant\nja\n42<|im_end|>\n"
    prompt = loaded.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids.count(2) == 2 and ids.count(3) == 2 and loaded.decode(ids) == text


def test_a_character_the_vocabulary_lacks_is_named_with_what_to_do_and_all_bytes_covers_it(tmp_path):
    narrow = saved(tmp_path, train_tokenizer(["abc"], TokenizerSpec()), name="narrow")
    with pytest.raises(TokenizerRoundTripError, match=r"'z' \(U\+007A LATIN SMALL LETTER Z\).*--all-bytes"):
        check_round_trip(narrow, ["abc", "abz"], sources=["a.txt:line 1", "a.txt:line 2"])
    with pytest.raises(TokenizerRoundTripError, match="a.txt:line 2"):
        check_round_trip(narrow, ["abc", "abz"], sources=["a.txt:line 1", "a.txt:line 2"])
    check_round_trip(saved(tmp_path, train_tokenizer(["abc"], TokenizerSpec(all_bytes=True)), name="wide"),
                     ["abz", "日本語 🙂\n"])


def test_a_qwen2_directory_normalizes_to_nfc_and_the_error_says_so(tmp_path):
    decomposed = unicodedata.normalize("NFD", "café")
    model_dir = saved(tmp_path, train_tokenizer([decomposed, "café"], TokenizerSpec()))
    with pytest.raises(TokenizerRoundTripError, match="NFC"):
        check_round_trip(model_dir, [decomposed])


def test_a_bpe_tokenizer_merges_frequent_words_and_still_round_trips(tmp_path):
    corpus = ["the cat sat on the mat\n"] * 50 + TEXTS
    fast = train_tokenizer(corpus, TokenizerSpec(model="bpe", vocab_size=120))
    model_dir = saved(tmp_path, fast)
    check_round_trip(model_dir, corpus)
    loaded = load_tokenizer(model_dir)
    assert len(loaded("the cat sat", add_special_tokens=False)["input_ids"]) < len("the cat sat")


def write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_the_corpus_reads_verl_and_chat_rows_jsonl_and_text(tmp_path):
    verl = write_rows(tmp_path / "train.parquet", [
        {"prompt": [{"role": "user", "content": "Wie viel ist 6·7?"}], "data_source": "mine",
         "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"answer": "zweiundvierzig", "i": 3}}])
    chat = tmp_path / "sft.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "tool", "content": "ok"}]}) + "\n\n")
    text = tmp_path / "notes.txt"
    text.write_text("eins\nzwei")
    corpus = read_corpus([verl, str(chat), str(text)])
    assert corpus.texts == ["Wie viel ist 6·7?", "42", "zweiundvierzig", "3", "hi", "ok", "eins\n", "zwei"]
    assert corpus.sources[1] == f"{verl}:row 0" and corpus.sources[-1] == f"{text}:line 2"
    assert corpus.conversations[0][0][-1] == {"role": "assistant", "content": "42"}  # the answer, rendered
    write_rows(tmp_path / "bad.parquet", [{"question": "no prompt column"}])
    with pytest.raises(CorpusError, match="'prompt' \\(verl\\) or 'messages'"):
        read_corpus([str(tmp_path / "bad.parquet")])
    with pytest.raises(CorpusError, match="does not exist"):
        read_corpus([str(tmp_path / "missing.txt")])


def test_init_model_puts_the_chat_templates_own_text_in_the_vocabulary(tmp_path):
    corpus = write_rows(tmp_path / "train.parquet", [
        {"prompt": [{"role": "user", "content": "sort 312"}], "reward_model": {"ground_truth": "123"}}])
    template = "{% for m in messages %}§{{ m['role'] }}» {{ m['content'] }}<|im_end|>{% endfor %}"
    built = init_model(str(tmp_path / "m"), [corpus], ModelShape("qwen2", 32, 1),
                       TokenizerSpec(chat_template=template), seed=0)
    loaded = load_tokenizer(built.path)
    text = loaded.apply_chat_template([{"role": "user", "content": "sort 312"}], tokenize=False)
    assert text == "§user» sort 312<|im_end|>"
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    assert built.vocab_size % 16 == 0 and built.vocab_size >= built.tokens == len(loaded)
    with pytest.raises(InitModelError, match="--force"):
        init_model(str(tmp_path / "m"), [corpus], ModelShape("qwen2", 32, 1))


def test_unsupported_families_and_shapes_are_refused_naming_what_works():
    with pytest.raises(InitModelError, match="supported: qwen2, qwen3, llama"):
        ModelShape("gpt2")
    with pytest.raises(InitModelError, match="--heads"):
        ModelShape("qwen2", hidden_size=96, heads=5)
    with pytest.raises(ValueError, match="--vocab-size N"):
        TokenizerSpec(model="bpe")
    with pytest.raises(ValueError, match="--tokenizer bpe"):
        TokenizerSpec(vocab_size=100)


def test_a_qwen2_is_exactly_build_qwen2s_so_the_demos_cached_assets_stay_valid():
    ours = build_model(ModelShape("qwen2", 64, 2, max_positions=128), 48, eos_token_id=3, pad_token_id=0, seed=7)
    theirs = build_qwen2(48, 64, 2, eos_token_id=3, pad_token_id=0, seed=7, max_positions=128)
    assert ours.config.to_dict() == theirs.config.to_dict()
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
