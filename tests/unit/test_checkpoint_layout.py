"""A published version in the layout of the model's files (generator/engines/checkpoint_layout.py): for the MoE
families, what `save_pretrained` writes, tensor for tensor; for the others, the version untouched. The vLLM
engine's check against the checkpoint takes the converted version and refuses the fused one it used to get."""
import logging

import pytest
import torch
from safetensors import safe_open

from asyncrl.generator.engines.checkpoint_layout import CheckpointLayout
from asyncrl.generator.engines.vllm_engine import check_against_checkpoint, checkpoint_shapes
from asyncrl.learner.families import build_family_model


def saved(model, directory) -> dict:
    model.save_pretrained(directory)
    out = {}
    with safe_open(f"{directory}/model.safetensors", framework="pt") as handle:
        for name in handle.keys():
            out[name] = handle.get_tensor(name)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fused_experts_become_the_files_tensors_one_per_expert(family, tmp_path):
    model = build_family_model(family, 40)
    state = model.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)  # fused in memory
    files = saved(model, tmp_path)
    layout = CheckpointLayout.for_config(model.config)
    assert layout.converts
    converted = dict(layout.convert(state.items()))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(converted) - tied == set(files)
    for name, tensor in files.items():
        torch.testing.assert_close(converted[name], tensor, atol=0, rtol=0, msg=name)
    shapes = layout.shapes(list(state), [tuple(t.shape) for t in state.values()])
    assert shapes == {name: tuple(tensor.shape) for name, tensor in converted.items()}
    expected = checkpoint_shapes(str(tmp_path))
    assert check_against_checkpoint(shapes, expected) == []
    fused = {name: tuple(t.shape) for name, t in state.items()}  # as published, unconverted: refused
    assert any("unknown tensor" in problem and "experts.gate_up_proj" in problem
               for problem in check_against_checkpoint(fused, expected))


def test_a_family_transformers_converts_nothing_for_passes_through_uncopied():
    model = build_family_model("qwen3", 40)
    layout = CheckpointLayout.for_config(model.config)
    assert not layout.converts
    pairs = list(model.state_dict().items())
    assert all(a is b for (_, a), (_, b) in zip(layout.convert(pairs), pairs))


def test_a_model_transformers_cannot_build_loads_as_published_with_a_warning(tmp_path, caplog):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_architecture"}')
    with caplog.at_level(logging.WARNING):
        layout = CheckpointLayout.for_model_dir(str(tmp_path))
    assert not layout.converts and "as the learner names them" in caplog.text
    pairs = [("w", torch.ones(2))]
    assert layout.convert(pairs) == pairs
