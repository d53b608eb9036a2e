"""Fixtures shared by the integration tests."""
import pytest

from tests.integration.helpers import VOCAB


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from asyncrl.learner.model import build_qwen2

    path = str(tmp_path_factory.mktemp("tiny-model"))
    model = build_qwen2(vocab_size=VOCAB, hidden_size=32, num_layers=1, eos_token_id=1, pad_token_id=0, seed=0)
    model.save_pretrained(path)
    return path
