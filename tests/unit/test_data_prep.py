"""`asyncrl data gsm8k|math` (launch/datasets.py) on a few hand-written rows in the public datasets' columns: the
verl parquet it writes is what the generators read, and its ground truths are what the built-in scorers grade."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.data.prompts import read_rows
from asyncrl.generator.rewards.functions import builtin_reward, score
from asyncrl.launch.cli import main
from asyncrl.launch.datasets import DataPrepError, convert, last_boxed

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How "
                 "much did she earn?", "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 10"},
    {"question": "A row whose answer lost its final line", "answer": "It is 5."},
    {"question": "Big numbers", "answer": "... #### 1,250"},
]
MATH_ROWS = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.",
     "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Nested", "solution": "So $x = \\boxed{\\sqrt{\\frac{1}{2}}}$ and that is it.", "level": "Level 3",
     "type": "Algebra"},
    {"problem": "No box at all", "solution": "The answer is 7.", "level": "Level 1", "type": "Algebra"},
]


def test_gsm8k_jsonl_becomes_verl_parquet_the_generators_read_and_the_scorer_grades(tmp_path, capsys):
    source = tmp_path / "gsm8k_train.jsonl"
    source.write_text("\n".join(json.dumps(row) for row in GSM8K_ROWS) + "\n")
    assert main(["data", "gsm8k", "--input", str(source), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "wrote 3 rows" in printed and "skipped 1 without a usable answer" in printed
    rows = read_rows([str(tmp_path / "out" / "train.parquet")])
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["72", "10", "1250"]
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["prompt"][0]["role"] == "user"
    assert rows[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert rows[1]["extra_info"]["index"] == 1 and rows[1]["extra_info"]["split"] == "train"
    assert score(builtin_reward, rows[2]["data_source"], "so #### 1250", rows[2]["reward_model"]["ground_truth"],
                 rows[2]["extra_info"])[0] == 1.0


def test_math_parquet_keeps_the_boxed_answer_and_skips_rows_without_one(tmp_path):
    source = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH_ROWS), source)
    path, written, skipped = convert("math", str(source), str(tmp_path / "out"), split="test")
    assert (written, skipped) == (2, 1) and path.endswith("test.parquet")
    rows = read_rows([path])
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["\\frac{3}{4}", "\\sqrt{\\frac{1}{2}}"]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[1]["extra_info"] == {"split": "test", "index": 1, "level": "Level 3", "type": "Algebra"}
    assert score(builtin_reward, rows[0]["data_source"], "\\boxed{0.75}", rows[0]["reward_model"]["ground_truth"],
                 None)[0] == 1.0


def test_math_500_rows_use_their_answer_column(tmp_path):
    source = tmp_path / "math500.jsonl"
    source.write_text(json.dumps({"problem": "2+2?", "solution": "four", "answer": "4"}) + "\n")
    path, written, _ = convert("math", str(source), str(tmp_path), data_source="HuggingFaceH4/MATH-500")
    assert written == 1 and read_rows([path])[0]["reward_model"]["ground_truth"] == "4"


def test_bad_inputs_say_what_is_wrong(tmp_path, capsys):
    assert main(["data", "gsm8k", "--input", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"problem": "x", "solution": "\\boxed{1}"}) + "\n")
    with pytest.raises(DataPrepError, match="no row has the gsm8k columns"):
        convert("gsm8k", str(wrong), str(tmp_path))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(DataPrepError, match="broken.jsonl:2: not a JSON line"):
        convert("gsm8k", str(broken), str(tmp_path))
    unanswered = tmp_path / "unanswered.jsonl"
    unanswered.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(DataPrepError, match="none of its 1 rows has a usable answer"):
        convert("gsm8k", str(unanswered), str(tmp_path))


def test_last_boxed_balances_braces_and_refuses_an_unclosed_box():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None
    assert last_boxed("nothing") is None
