"""`asyncrl init-model` as a user runs it, on a task of their own (verl rows and a text file): the directory it
writes is loaded by the learner's loaders and the hf engine, its chat-rendered prompts tokenize and sample, and
one SFT step on the user's rows trains it."""
import asyncio
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from asyncrl.buffer.group import Sampling
from asyncrl.data.sft import read_sft_examples
from asyncrl.generator.engines.base import EngineOptions
from asyncrl.generator.engines.hf_engine import HfEngine
from asyncrl.learner.model import load_model, load_tokenizer
from asyncrl.learner.sft import run_sft


def user_task(tmp_path) -> list:
    rows = [{"prompt": [{"role": "user", "content": f"Wie viel ist {a} mal {a + 3}? Kurz, bitte."}],
             "data_source": "my_task", "reward_model": {"style": "rule", "ground_truth": str(a * (a + 3))},
             "extra_info": {"index": a, "split": "train"}} for a in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "train.parquet"))
    (tmp_path / "notes.txt").write_text("Grüße – naïve café ∑\n\ttabs  and spaces\n", encoding="utf-8")
    return [str(tmp_path / "train.parquet"), str(tmp_path / "notes.txt")]


def test_init_model_writes_a_directory_the_learner_and_the_hf_engine_load_and_sft_trains(tmp_path):
    train, notes = user_task(tmp_path)
    out = str(tmp_path / "my-model")
    run = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "init-model", "--out", out, "--corpus", train,
                          "--corpus", notes, "--hidden", "64", "--layers", "2", "--seed", "1"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"init-model: wrote {out}: qwen2" in run.stdout
    assert f"asyncrl sft model.path={out} data.train_files=[{train}]" in run.stdout

    tokenizer, model = load_tokenizer(out), load_model(out).eval()
    assert model.config.vocab_size % 16 == 0 and len(tokenizer) <= model.config.vocab_size
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(
        "<|im_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Wie viel ist 7 mal 10? Kurz, bitte."}],
                                           tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), model.config.vocab_size) and torch.isfinite(logits).all()

    engine = HfEngine(EngineOptions(out, "float32", max_model_len=128, kv_cache_gib=1, seed=0))

    async def sample():
        await engine.start()
        try:
            return await engine.sample(prompt, Sampling(temperature=1.0, max_tokens=6), 2)
        finally:
            await engine.close()

    completions = asyncio.run(sample())
    assert len(completions) == 2 and all(0 < len(c.token_ids) <= 6 for c in completions)
    assert tokenizer.eos_token_id in engine.eos_token_id

    examples = read_sft_examples([train], tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    losses = run_sft(model, examples, steps=1, lr=1e-3, batch_size=8, seed=0)
    assert len(losses) == 1 and 0 < losses[0] < 20
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_init_model_help_is_fast_and_a_missing_corpus_exits_2_naming_it_without_importing_torch(tmp_path):
    code = ("import sys; from asyncrl.launch.cli import main\n"
            "try: main(['init-model', '--help'])\nexcept SystemExit as e: assert e.code == 0, e.code\n"
            f"rc = main(['init-model', '--out', {str(tmp_path / 'm')!r}, '--corpus', 'missing.txt'])\n"
            "assert rc == 2, rc; assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "qwen2" in out.stdout and "llama" in out.stdout and "--corpus" in out.stdout
    assert "corpus file 'missing.txt' does not exist" in out.stderr
    assert not os.path.exists(tmp_path / "m")
