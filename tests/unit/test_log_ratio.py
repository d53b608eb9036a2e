"""The one masked, clamped log-ratio of asyncrl.algos (log_ratio.py) and the one LOG_RATIO_CLAMP."""
import ast
import math
from pathlib import Path

import pytest
import torch

import asyncrl.algos
from asyncrl.algos.log_ratio import LOG_RATIO_CLAMP, masked_log_ratio

F64 = torch.float64
NAN, INF = math.nan, math.inf


def test_masked_positions_are_zero_whatever_they_hold():
    logprobs = torch.tensor([[-1.0, -INF, NAN, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -INF, -1.0, INF]], dtype=F64)
    valid = torch.tensor([[True, False, False, False]])
    assert masked_log_ratio(logprobs, ref, valid).tolist() == [[0.5, 0.0, 0.0, 0.0]]


def test_nan_on_a_valid_token_counts_as_zero():
    out = masked_log_ratio(torch.tensor([[NAN, -1.0]], dtype=F64), torch.tensor([[-1.0, NAN]], dtype=F64),
                           torch.ones(1, 2, dtype=torch.bool))
    assert out.tolist() == [[0.0, 0.0]]


def test_infinities_and_large_ratios_are_clamped():
    logprobs = torch.tensor([[0.0, -INF, -1.0, -40.0, 0.0]], dtype=F64)
    ref = torch.tensor([[-INF, 0.0, -41.0, -1.0, 0.0]], dtype=F64)
    out = masked_log_ratio(logprobs, ref, torch.ones(1, 5, dtype=torch.bool))
    assert out.tolist() == [[LOG_RATIO_CLAMP, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP, -LOG_RATIO_CLAMP, 0.0]]
    unclamped = masked_log_ratio(logprobs, ref, torch.ones(1, 5, dtype=torch.bool), clamp=False)
    assert unclamped.tolist() == [[INF, -INF, 40.0, -39.0, 0.0]]


@pytest.mark.parametrize("dtypes, min_dtype, want", [
    ((torch.bfloat16, torch.bfloat16), torch.float32, torch.float32),  # bf16 differences lose their digits
    ((torch.bfloat16, F64), torch.float32, F64),  # the wider input wins
    ((torch.float32, torch.float32), F64, F64),  # the metrics' fp64 floor
])
def test_dtype_is_the_widest_of_the_inputs_and_the_floor(dtypes, min_dtype, want):
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=dtypes[0])
    ref = torch.tensor([[-1.5, -2.5]], dtype=dtypes[1])
    out = masked_log_ratio(logprobs, ref, torch.ones(1, 2, dtype=torch.bool), min_dtype)
    assert out.dtype == want and out.tolist() == [[0.5, 0.5]]


def test_gradient_reaches_logprobs_on_valid_tokens_only_and_stays_finite():
    logprobs = torch.tensor([[-1.0, -INF, -2.0, -50.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -INF, NAN, -1.0]], dtype=F64)
    valid = torch.tensor([[True, False, False, True]])
    out = masked_log_ratio(logprobs, ref, valid)
    assert not out.detach().isnan().any()
    (grad,) = torch.autograd.grad(out.sum(), logprobs)
    assert grad.tolist() == [[1.0, 0.0, 0.0, 0.0]]  # the clamped token (δ = -49) has no gradient either


def test_log_ratio_clamp_is_defined_in_exactly_one_module():
    defining = []
    for path in sorted(Path(list(asyncrl.algos.__path__)[0]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            if any(isinstance(t, ast.Name) and t.id == "LOG_RATIO_CLAMP" for t in targets):
                defining.append(path.name)
    assert defining == ["log_ratio.py"]
