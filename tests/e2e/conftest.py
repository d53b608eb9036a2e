"""Fixtures shared by the end-to-end tests."""
import pytest

from tests.e2e.jobs import VOCAB


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from asyncrl.learner.model import build_qwen2

    path = str(tmp_path_factory.mktemp("tiny-model"))
    build_qwen2(vocab_size=VOCAB, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0,
                seed=0).save_pretrained(path)
    return path
