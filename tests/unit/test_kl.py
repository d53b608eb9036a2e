"""fp64 tests for asyncrl.algos.kl (docs/algorithms.md §1.16, §5 T11, T15).

T11 is exact, not Monte Carlo: the whole vocabulary of a categorical policy is enumerated, so an expectation
under π_θ is the sum Σ_y π_θ(y)·f(y), with π_θ(y) detached where the samples are held fixed.
"""
import math

import pytest
import torch

from asyncrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl,
)

F64 = torch.float64
V = 7


def categorical(seed):
    """Logits z (with grad) of π_θ and log π_ref, both [1, V]: one "token" per vocabulary entry."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(1, V, generator=gen, dtype=F64).requires_grad_()
    logprobs_ref = torch.log_softmax(torch.randn(1, V, generator=gen, dtype=F64), dim=-1)
    return z, logprobs_ref


def expectation_under_pi(z, values):
    """Σ_y sg(π_θ(y)) · values(y): the expectation over samples y ~ π_θ held fixed."""
    return (torch.softmax(z, -1).detach() * values).sum()


def exact_kl(logp, logq):
    return (logp.exp() * (logp - logq)).sum()


# T11 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_and_k3_are_unbiased_estimates_of_kl(seed):
    z, logprobs_ref = categorical(seed)
    logprobs = torch.log_softmax(z, -1).detach()
    kl = exact_kl(logprobs, logprobs_ref)
    for kind in ("k1", "k3", "k3+"):
        estimate = expectation_under_pi(z, compute_kl(logprobs, logprobs_ref, kind))
        assert estimate.item() == pytest.approx(kl.item(), abs=1e-12), kind
    k2 = expectation_under_pi(z, compute_kl(logprobs, logprobs_ref, "k2"))
    assert abs(k2.item() - kl.item()) > 1e-3  # k2's value is biased


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k2_gives_the_exact_kl_gradient_and_k1_gives_none(seed):
    z, logprobs_ref = categorical(seed)
    (want,) = torch.autograd.grad(exact_kl(torch.log_softmax(z, -1), logprobs_ref), z)
    grads = {}
    for kind in ("k1", "k2", "k3", "k3+"):
        surrogate = expectation_under_pi(z, compute_kl(torch.log_softmax(z, -1), logprobs_ref, kind))
        (grads[kind],) = torch.autograd.grad(surrogate, z)
    torch.testing.assert_close(grads["k2"], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads["k3+"], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads["k1"], torch.zeros_like(want), rtol=0, atol=1e-12)
    # k3's gradient is that of the REVERSE KL(π_ref ‖ π_θ) = Σ π_ref (log π_ref - log π_θ)
    (reverse,) = torch.autograd.grad(exact_kl(logprobs_ref, torch.log_softmax(z, -1)), z)
    torch.testing.assert_close(grads["k3"], reverse, rtol=0, atol=1e-12)
    assert (grads["k3"] - want).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_k3_is_never_negative_even_where_exp_minus_one_cancels(dtype):
    tiny = torch.logspace(-20, 0, 20001, dtype=F64)  # |δ| < 1: exp(-δ) - 1 + δ rounds below 0 for many of these
    log_ratio = torch.cat([torch.linspace(-25, 25, 1001, dtype=F64), tiny, -tiny])[None, :].to(dtype)
    assert (compute_kl(log_ratio, torch.zeros_like(log_ratio), "k3") >= 0).all()


def test_k3_plus_has_the_value_of_k3_and_the_gradient_of_k2():
    logprobs = torch.tensor([[-0.3, -2.0, -0.01, -5.0]], dtype=F64, requires_grad=True)
    logprobs_ref = torch.tensor([[-1.0, -0.5, -0.02, -1.0]], dtype=F64)
    plus = compute_kl(logprobs, logprobs_ref, "k3+")
    assert torch.equal(plus, compute_kl(logprobs, logprobs_ref, "k3"))
    (grad_plus,) = torch.autograd.grad(plus.sum(), logprobs)
    (grad_k2,) = torch.autograd.grad(compute_kl(logprobs, logprobs_ref, "k2").sum(), logprobs)
    assert torch.equal(grad_plus, grad_k2)
    torch.testing.assert_close(grad_k2, (logprobs - logprobs_ref).detach(), rtol=0, atol=1e-15)  # d(δ²/2)/dδ = δ


def test_estimators_match_hand_values():
    logprobs, logprobs_ref = torch.tensor([[math.log(2.0)]], dtype=F64), torch.zeros(1, 1, dtype=F64)
    # δ = ln 2: k1 = ln 2, k2 = (ln 2)² / 2, k3 = 1/2 - 1 + ln 2
    want = {"k1": math.log(2), "k2": 0.5 * math.log(2) ** 2, "k3": math.log(2) - 0.5, "k3+": math.log(2) - 0.5,
            "abs": math.log(2)}
    for kind, value in want.items():
        assert compute_kl(logprobs, logprobs_ref, kind).item() == pytest.approx(value, abs=1e-15), kind
    assert set(KL_ESTIMATORS) == set(want)


def test_abs_is_the_magnitude_of_the_log_ratio_with_a_sign_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    logprobs_ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=F64)  # δ = 0.5, -1.0, 0
    kl = compute_kl(logprobs, logprobs_ref, "abs", loss_mask=torch.tensor([[1, 1, 0]]))
    assert kl.tolist() == [[0.5, 1.0, 0.0]]
    kl.sum().backward()
    assert logprobs.grad.tolist() == [[1.0, -1.0, 0.0]]  # sign(δ) on valid tokens, 0 off the mask


def test_k3_clamps_the_log_ratio_and_the_result_like_verl():
    logprobs = torch.tensor([[-40.0, -0.0, -3.0]], dtype=F64)
    logprobs_ref = torch.tensor([[-10.0, -30.0, -1.0]], dtype=F64)
    k3 = compute_kl(logprobs, logprobs_ref, "k3")
    # δ = -30 -> -20: e^20 - 1 - 20 -> 10; δ = +30 -> 20: e^-20 - 1 + 20 = 19.0... -> 10; δ = -2: e^2 - 3, unclamped
    assert k3[0, :2].tolist() == [10.0, 10.0]
    assert k3[0, 2].item() == pytest.approx(math.exp(2) - 3, abs=1e-14)
    assert compute_kl(logprobs, logprobs_ref, "k1")[0, 0].item() == -30.0  # k1 is not clamped


def test_k1_and_k2_are_not_clamped_with_a_mask_either():
    logprobs, logprobs_ref = torch.tensor([[-40.0, -1.0]], dtype=F64), torch.tensor([[-10.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    assert compute_kl(logprobs, logprobs_ref, "k1", loss_mask=mask)[0].tolist() == [-30.0, 0.0]
    assert compute_kl(logprobs, logprobs_ref, "k2", loss_mask=mask)[0].tolist() == [450.0, 0.0]
    assert compute_kl(logprobs, logprobs_ref, "k3", loss_mask=mask)[0].tolist() == [10.0, 0.0]


@pytest.mark.parametrize("kind", sorted(KL_ESTIMATORS))
def test_masked_garbage_gives_zero_and_finite_gradients(kind):
    logprobs = torch.tensor([[-0.5, -float("inf"), float("nan")]], dtype=F64, requires_grad=True)
    logprobs_ref = torch.tensor([[-0.7, -float("inf"), -1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 0.0]], dtype=F64)
    kl = compute_kl(logprobs, logprobs_ref, kind, loss_mask=mask)
    assert kl[0, 1:].tolist() == [0.0, 0.0] and torch.isfinite(kl).all()
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert torch.isfinite(grad).all() and grad[0, 1:].tolist() == [0.0, 0.0]


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        compute_kl(torch.zeros(1, 1), torch.zeros(1, 1), "low_var_kl")


# Reward penalty -------------------------------------------------------------------------------------------
def test_kl_penalty_shapes_valid_rewards_and_zeroes_the_rest():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0, float("nan")]], dtype=F64)
    logprobs_behav = torch.tensor([[-1.0, -2.0, -0.5, -float("inf")]], dtype=F64, requires_grad=True)
    logprobs_ref = torch.tensor([[-1.5, -2.0, -0.3, -float("inf")]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    shaped, kl = apply_kl_penalty(token_rewards, logprobs_behav, logprobs_ref, mask, coef=0.1, kind="k1")
    # k1 = [0.5, 0, -0.2, masked]; r - 0.1 k1 = [-0.05, 0, 1.02, 0]
    assert kl[0].tolist() == pytest.approx([0.5, 0.0, -0.2, 0.0], abs=1e-15)
    assert shaped[0].tolist() == pytest.approx([-0.05, 0.0, 1.02, 0.0], abs=1e-15)
    assert not shaped.requires_grad and not kl.requires_grad


def test_kl_penalty_uses_the_chosen_estimator():
    token_rewards, mask = torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64)
    behav, ref = torch.tensor([[math.log(2.0)]], dtype=F64), torch.zeros(1, 1, dtype=F64)
    for kind in ("k3", "k3+"):
        shaped, kl = apply_kl_penalty(token_rewards, behav, ref, mask, coef=2.0, kind=kind)
        assert kl.item() == pytest.approx(math.log(2) - 0.5, abs=1e-15)
        assert shaped.item() == pytest.approx(-2.0 * (math.log(2) - 0.5), abs=1e-15)


# Controllers ----------------------------------------------------------------------------------------------
def test_fixed_controller_never_moves():
    ctrl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctrl.update(kl, n_steps=512)
    assert ctrl.value == 0.05


@pytest.mark.parametrize("current_kl, want_mult", [
    (0.11, 1 + 0.1 * 10 / 100),  # 10 % above target: proportional
    (1.00, 1 + 0.2 * 10 / 100),  # 900 % above: clipped at +20 %
    (0.10, 1.0),  # on target: unchanged
    (0.09, 1 - 0.1 * 10 / 100),
    (0.00, 1 - 0.2 * 10 / 100),  # clipped at -20 %
])
def test_adaptive_controller_follows_ziegler_update(current_kl, want_mult):
    ctrl = AdaptiveKLController(init_coef=0.1, target=0.1, horizon=100)
    ctrl.update(current_kl, n_steps=10)
    assert ctrl.value == pytest.approx(0.1 * want_mult, rel=1e-12)


def test_adaptive_controller_drives_kl_toward_its_target():
    # Toy closed loop: the KL the policy reaches is inversely proportional to β (KL = 0.002 / β, so β* = 0.02).
    ctrl = AdaptiveKLController(init_coef=0.01, target=0.1, horizon=1000)
    for _ in range(2000):
        ctrl.update(0.002 / ctrl.value, n_steps=256)
    assert 0.002 / ctrl.value == pytest.approx(0.1, rel=1e-3)


def test_controllers_reject_nonsense():
    with pytest.raises(ValueError):
        FixedKLController(-1.0)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=100)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.1, horizon=0)
