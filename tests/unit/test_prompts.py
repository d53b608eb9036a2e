"""Prompts (data/prompts.py): one PromptRow whether a generator walks its own copy or the learner deals it, the
row's encoding for a deal checked like network input on the generator, and the learner's prompt sets."""
import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.buffer.dealing import DealError, PromptDealer
from asyncrl.data.config import DataConfig
from asyncrl.data.prompts import (DatasetError, PromptRow, decode_prompt, encode_prompt, encode_prompts,
                                  iterate_prompts, load_train_prompts, read_rows, tokenize_rows)


class CharTokenizer:
    """One token per character of the rendered prompt: enough to test what fits data.max_prompt_tokens."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(message["content"] for message in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(char) % 50 for char in text]}


def write_rows(path, questions):
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": question}], "data_source": "openai/gsm8k",
         "reward_model": {"ground_truth": str(len(question))}, "extra_info": {"index": index}}
        for index, question in enumerate(questions)]), path)


def test_a_dealt_row_round_trips_with_its_deal_id_and_a_malformed_one_is_refused():
    row = PromptRow("a:0", [5, 6, 7], "s", ["x", 1], {"k": {"n": 2}}, messages=[{"role": "user"}])
    got = decode_prompt("d1", encode_prompt(row))
    assert got == PromptRow("a:0", [5, 6, 7], "s", ["x", 1], {"k": {"n": 2}}, [{"role": "user"}], deal_id="d1")
    for blob in (b"\xc1", msgpack.packb([1]), msgpack.packb({"prompt_id": "a", "prompt_ids": b"\x01\x02\x03",
                                                             "data_source": "s", "extra_info": {}})):
        with pytest.raises(DealError):
            decode_prompt("d", blob)
    with pytest.raises(DealError, match="deal id, row bytes"):
        decode_prompt(None, encode_prompt(row))
    with pytest.raises(DealError, match="a:1"):  # at load time, naming the row
        encode_prompt(PromptRow("a:1", [1], "s", object(), {}))


def test_walked_rows_carry_no_deal_and_prompts_too_long_are_left_out_and_counted(tmp_path):
    write_rows(tmp_path / "train.parquet", ["short", "a question far too long to fit", "tiny"])
    rows, overlong = tokenize_rows(read_rows([str(tmp_path / "train.parquet")]), CharTokenizer(), 8)
    assert overlong == 1 and [row.prompt_id for row in rows] == ["train.parquet:0", "train.parquet:2"]
    assert rows[0].deal_id is None and rows[0].ground_truth == "5" and rows[0].extra_info == {"index": 0}
    assert rows[0].messages == [{"role": "user", "content": "short"}] and len(rows[0].prompt_ids) == 5
    walked = iterate_prompts(rows, shuffle=True, seed=1)
    assert sorted(next(walked).prompt_id for _ in range(4)) == sorted([row.prompt_id for row in rows] * 2)
    with pytest.raises(DatasetError, match="no prompt fits"):
        tokenize_rows(read_rows([str(tmp_path / "train.parquet")]), CharTokenizer(), 3)


def test_the_dealer_deals_the_rows_it_was_given_and_the_generator_decodes_the_same_row():
    rows = [PromptRow(f"p{i}", [1, 2 + i], "b" if i else "a", str(i), {}) for i in range(3)]
    prompts = encode_prompts(rows)
    assert prompts.prompt_ids == ["p0", "p1", "p2"] and prompts.data_sources == ["a", "b", "b"]
    dealer = PromptDealer(prompts, shuffle=False, seed=0, epochs=1, timeout_s=60.0)
    assert dealer.data_sources == ["a", "b"]
    dealt = [decode_prompt(*deal) for deal in dealer.deal("g", 3)]
    assert [(row.prompt_id, row.prompt_ids, row.ground_truth) for row in dealt] == [
        (row.prompt_id, row.prompt_ids, row.ground_truth) for row in rows]
    assert all(row.deal_id for row in dealt) and len({row.deal_id for row in dealt}) == 3


def test_a_job_without_files_deals_nothing_and_a_missing_file_is_named(tmp_path):
    assert load_train_prompts(DataConfig(), [], str(tmp_path), seed=0) is None
    with pytest.raises(DatasetError, match="nowhere.parquet"):
        load_train_prompts(DataConfig(), [str(tmp_path / "nowhere.parquet")], str(tmp_path), seed=0)


def test_a_multimodal_rows_images_are_read_rendered_dealt_and_checked_on_arrival(tmp_path):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    png = buffer.getvalue()
    (tmp_path / "b.png").write_bytes(png)
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": "<image><image>how many?"}], "data_source": "count",
         "reward_model": {"ground_truth": "2"}, "extra_info": {"k": 1}, "images": [{"bytes": png, "path": None},
                                                                            {"bytes": None, "path": "b.png"}]},
        {"prompt": [{"role": "user", "content": "no image"}], "data_source": "count",
         "reward_model": {"ground_truth": "0"}, "extra_info": {"k": 2}, "images": []}]), tmp_path / "train.parquet")
    with pytest.raises(DatasetError, match="train.parquet:0 has images, and the model is not a vision-language"):
        tokenize_rows(read_rows([str(tmp_path / "train.parquet")]), CharTokenizer(), 200)
    rows, _ = tokenize_rows(read_rows([str(tmp_path / "train.parquet")]), CharTokenizer(), 200, vision=Pads(3))
    assert rows[0].images == [png, png] and rows[1].images is None
    assert rows[0].messages[0]["content"] == "<image><image>how many?"  # the row's own text, for episodes
    assert len(rows[0].prompt_ids) == 2 * len("<|vision_start|><|image_pad|><|vision_end|>") + len("how many?")
    assert decode_prompt("d", encode_prompt(rows[0])).images == [png, png]
    assert "images" not in msgpack.unpackb(encode_prompt(rows[1]))
    for images in ([], "x", [b""], [1], [b"a"] * 65):
        blob = msgpack.packb({**msgpack.unpackb(encode_prompt(rows[0])), "images": images}, use_bin_type=True)
        with pytest.raises(DealError, match="images must be a list of 1 to 64"):
            decode_prompt("d", blob)
    with pytest.raises(DatasetError, match=r"train.parquet:0: 2 images, more than data.max_images=1"):
        tokenize_rows(read_rows([str(tmp_path / "train.parquet")]), CharTokenizer(), 200, max_images=1,
                      vision=Pads(3))
    # what must fit is the prompt once each image pad is widened to its image's patches
    fits = len(rows[0].prompt_ids) + 2 * (50 - 1)
    for pads, kept in ((50, 2), (51, 1)):
        rows, skipped = tokenize_rows(read_rows([str(tmp_path / "train.parquet")]), CharTokenizer(), fits,
                                      vision=Pads(pads))
        assert (len(rows), skipped) == (kept, 2 - kept)


class Pads:
    """A vision processor that widens every image to `count` pads (tokenize_rows only asks how many)."""

    def __init__(self, count):
        self.count = count

    def pads_of(self, image):
        return self.count
