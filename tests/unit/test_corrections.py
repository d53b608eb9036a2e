"""Golden fp64 tests for off-policy corrections, A-3PO, V-trace and off-policy metrics
(docs/algorithms.md §2, §3 and §5: T1, T7, T8, T10, T12, T15)."""
import inspect
import math

import pytest
import torch

from asyncrl.algos import corrections
from asyncrl.algos.corrections import (
    CORRECTION_WEIGHTS,
    EMPTY_MIN,
    approximate_prox_logprobs,
    compute_correction,
)
from asyncrl.algos.metrics import (
    EMPTY_OFFPOLICY_METRICS,
    combine_token_metrics,
    compute_offpolicy_metrics,
    compute_staleness_metrics,
)
from asyncrl.algos.registry import ADVANTAGES, BYPASS_PG_CORRECTION, CORRECTIONS, WEIGHT, keyword_defaults
from asyncrl.algos.vtrace import compute_vtrace, compute_vtrace_advantages

F64 = torch.float64
NAN, INF = math.nan, math.inf
WEIGHTED = sorted(CORRECTION_WEIGHTS)


def logprobs_with_ratios(log_rhos, seed=0):
    """(prox, behav, mask) [B, T] from rows of log ρ (None = padding, which holds -inf logprobs)."""
    width = max(len(row) for row in log_rhos)
    gen = torch.Generator().manual_seed(seed)
    behav = -torch.rand(len(log_rhos), width, generator=gen, dtype=F64) - 0.1
    mask = torch.zeros(len(log_rhos), width, dtype=F64)
    log_rho = torch.zeros(len(log_rhos), width, dtype=F64)
    for i, row in enumerate(log_rhos):
        for t, value in enumerate(row):
            if value is not None:
                mask[i, t], log_rho[i, t] = 1.0, value
    valid = mask.bool()
    prox = torch.where(valid, behav + log_rho, -INF)
    return prox, torch.where(valid, behav, -INF), mask


def close(value, want):
    return float(value) == pytest.approx(want, rel=1e-12, abs=1e-12)


def assert_weight(weight, want):
    torch.testing.assert_close(weight, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)


def random_batch(seed=0, lengths=(3, 6, 0, 5, 1, 4), width=6, scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(F64)
    behav = torch.log(torch.rand(len(lengths), width, generator=gen, dtype=F64) * 0.9 + 0.05)
    prox = behav + scale * torch.randn(len(lengths), width, generator=gen, dtype=F64)
    valid = mask.bool()
    return torch.where(valid, prox, -INF), torch.where(valid, behav, -INF), mask


# Registry -----------------------------------------------------------------------------------------------------
def test_registry_builds_the_weight_functions_and_says_which_are_batch_global():
    assert set(CORRECTION_WEIGHTS) == {"decoupled", "tis", "mis", "seq_mis", "geo_rs", "k3_rs", "icepop", "rs",
                                       "m2po"}
    assert {name for name, spec in CORRECTIONS.items() if spec.kind == WEIGHT} == set(CORRECTION_WEIGHTS)
    assert {name for name, spec in CORRECTIONS.items() if spec.batch_global} == {"m2po", "vtrace"}


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_registry_entry_keywords_are_exactly_its_functions_keywords(name):
    spec = CORRECTIONS[name]
    if spec.function is not None:
        function = getattr(corrections, spec.function)
        assert CORRECTION_WEIGHTS[name] is function
        assert list(inspect.signature(function).parameters)[:3] == ["logprobs_prox", "logprobs_behav", "loss_mask"]
        assert set(keyword_defaults(function)) == set(spec.fields.values())
    elif spec.kind == ADVANTAGES:  # vtrace: its hyperparameters are the advantage function's
        assert set(keyword_defaults(compute_vtrace_advantages)) == set(spec.fields.values())
    else:  # none has none; bypass's cap is that of the weight it gives the plain policy-gradient losses
        assert set(spec.fields.values()) <= set(keyword_defaults(CORRECTION_WEIGHTS[BYPASS_PG_CORRECTION]))


def test_published_defaults_are_the_functions_keyword_defaults():
    defaults = {name: keyword_defaults(fn) for name, fn in CORRECTION_WEIGHTS.items()}
    assert defaults == {
        "decoupled": {"cap": 5.0, "mode": "truncate"}, "tis": {"cap": 2.0, "level": "token"},
        "mis": {"cap": 2.0, "level": "token"}, "geo_rs": {"low": 0.999, "high": 1.001}, "k3_rs": {"threshold": 0.01},
        "icepop": {"low": 0.5, "high": 5.0}, "m2po": {"threshold": 0.04}, "seq_mis": {"cap": 2.0, "low": None},
        "rs": {"level": "sequence", "stat": "k3", "agg": "mean", "low": None, "high": 0.01, "weight": "one"}}


def test_unknown_names_hyperparameters_and_invalid_values_are_rejected():
    x = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError, match="unknown correction"):
        compute_correction("bogus", x, x, x)
    with pytest.raises(ValueError, match="takes"):
        compute_correction("tis", x, x, x, mode="mask")
    with pytest.raises(ValueError, match="level"):
        compute_correction("mis", x, x, x, level="tokens")
    with pytest.raises(ValueError, match="mode"):
        compute_correction("decoupled", x, x, x, mode="clamp")
    with pytest.raises(ValueError, match="low <= high"):
        compute_correction("icepop", x, x, x, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="cap"):
        compute_correction("tis", x, x, x, cap=0.0)
    with pytest.raises(ValueError, match="threshold"):
        compute_correction("m2po", x, x, x, threshold=0.0)


def test_no_correction_gives_no_weight():
    prox, behav, mask = random_batch()
    assert compute_correction("none", prox, behav, mask) == (None, {})


# T1: identity -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", WEIGHTED)
def test_identical_policies_give_weight_one_on_valid_tokens_and_trivial_metrics(name):
    _, same, mask = random_batch()
    weight, metrics = compute_correction(name, same, same, mask)
    assert torch.equal(weight, mask)  # exactly 1 on valid tokens, 0 off-mask
    combined = combine_token_metrics([metrics])
    for key in ("offpolicy/masked_frac", "offpolicy/truncated_frac", "offpolicy/seq_masked_frac"):
        assert combined[key] == 0.0
    assert combined["offpolicy/is_weight/ess"] == 1.0 and combined["offpolicy/is_weight/std"] == 0.0
    assert combined["offpolicy/is_weight/min"] == combined["offpolicy/is_weight/max"] == 1.0


def test_identical_policies_give_trivial_offpolicy_metrics():
    _, same, mask = random_batch()
    m = compute_offpolicy_metrics(same, same, mask)
    for key in ("mismatch_k1", "mismatch_k3", "abs_diff", "abs_diff/max", "tis_abs", "log_ppl_diff", "chi2_token",
                "chi2_seq"):
        assert m[f"offpolicy/{key}"] == 0.0, key
    assert m["offpolicy/ess"] == 1.0 and m["offpolicy/ppl_ratio"] == 1.0
    assert m["offpolicy/ppl_prox"] == m["offpolicy/ppl_behav"] > 1.0


# T7 -----------------------------------------------------------------------------------------------------------
T7_RATIOS = [0.4, 1.0, 1.5, 3.0, 10.0]


def t7_batch():
    return logprobs_with_ratios([[math.log(r) for r in T7_RATIOS] + [None]])


@pytest.mark.parametrize("name, hyper, want, truncated, masked", [
    ("tis", {"cap": 2.0}, [0.4, 1.0, 1.5, 2.0, 2.0], 0.4, 0.0),
    ("decoupled", {"cap": 2.0, "mode": "truncate"}, [0.4, 1.0, 1.5, 2.0, 2.0], 0.4, 0.0),
    ("mis", {"cap": 2.0}, [0.4, 1.0, 1.5, 0.0, 0.0], 0.0, 0.4),
    ("decoupled", {"cap": 2.0, "mode": "mask"}, [0.4, 1.0, 1.5, 0.0, 0.0], 0.0, 0.4),
    ("icepop", {"low": 0.5, "high": 5.0}, [0.0, 1.0, 1.5, 3.0, 0.0], 0.0, 0.4),
])
def test_t7_token_truncation_masking_and_icepop(name, hyper, want, truncated, masked):
    prox, behav, mask = t7_batch()
    weight, m = compute_correction(name, prox, behav, mask, **hyper)
    assert_weight(weight, [want + [0.0]])
    assert close(m["offpolicy/truncated_frac"], truncated) and close(m["offpolicy/masked_frac"], masked)
    assert close(m["offpolicy/seq_masked_frac"], 1.0 if masked else 0.0)
    # Statistics of the weight before truncation / masking.
    assert close(m["offpolicy/is_weight/mean"], sum(T7_RATIOS) / 5)
    assert close(m["offpolicy/is_weight/max"], 10.0) and close(m["offpolicy/is_weight/min"], 0.4)
    assert close(m["offpolicy/is_weight/ess"], sum(T7_RATIOS) ** 2 / (5 * sum(r * r for r in T7_RATIOS)))
    low_high = {"icepop": (1 / 5, 1 / 5)}.get(name, (1 / 5, 2 / 5))  # [0.5, 5] vs [1/C, C] = [0.5, 2]
    assert close(m["offpolicy/is_weight/frac_low"], low_high[0])
    assert close(m["offpolicy/is_weight/frac_high"], low_high[1])


def test_bounds_are_inclusive():
    # exp(log x) is exact for these powers of two: a ratio equal to the bound is kept, untouched.
    behav = torch.zeros(1, 3, dtype=F64)
    prox = torch.log(torch.tensor([[0.5, 2.0, 4.0]], dtype=F64))
    mask = torch.ones(1, 3)
    assert_weight(compute_correction("mis", prox, behav, mask, cap=2.0)[0], [[0.5, 2.0, 0.0]])
    weight, m = compute_correction("tis", prox, behav, mask, cap=2.0)
    assert close(m["offpolicy/truncated_frac"], 1 / 3) and close(m["offpolicy/is_weight/frac_low"], 0.0)
    _, m = compute_correction("tis", prox, behav, mask, cap=1.0)  # frac_low counts w < 1/cap = 1
    assert close(m["offpolicy/is_weight/frac_low"], 1 / 3) and close(m["offpolicy/is_weight/frac_high"], 2 / 3)
    assert_weight(compute_correction("icepop", prox, behav, mask, low=0.5, high=4.0)[0], [[0.5, 2.0, 4.0]])


def test_corrections_at_their_published_defaults():
    prox, behav, mask = t7_batch()
    assert_weight(compute_correction("tis", prox, behav, mask)[0], [[0.4, 1.0, 1.5, 2.0, 2.0, 0.0]])
    assert_weight(compute_correction("decoupled", prox, behav, mask)[0], [[0.4, 1.0, 1.5, 3.0, 5.0, 0.0]])
    assert_weight(compute_correction("icepop", prox, behav, mask)[0], [[0.0, 1.0, 1.5, 3.0, 0.0, 0.0]])


# Sequence-level TIS / MIS -------------------------------------------------------------------------------------
def seq_batch():
    # ρ(y) = 2·1.5 = 3; 0.5·0.8 = 0.4; 1.2; and a row whose log-ratio sum 30 is clamped to 20.
    return logprobs_with_ratios([[math.log(2), math.log(1.5), None], [math.log(0.5), math.log(0.8), None],
                                 [math.log(1.2), None, None], [10.0, 10.0, 10.0]])


def test_sequence_level_tis_truncates_the_product_of_ratios():
    prox, behav, mask = seq_batch()
    weight, m = compute_correction("tis", prox, behav, mask, cap=2.0, level="sequence")
    assert_weight(weight, [[2, 2, 0], [0.4, 0.4, 0], [1.2, 0, 0], [2, 2, 2]])
    assert close(m["offpolicy/truncated_frac"], 5 / 8) and close(m["offpolicy/masked_frac"], 0.0)
    assert close(m["offpolicy/is_weight/max"], math.exp(20.0))  # Σ log ρ clamped at 20 before exp
    assert close(m["offpolicy/is_weight/seq_mean"], (3 + 0.4 + 1.2 + math.exp(20.0)) / 4)


def test_sequence_level_mis_drops_whole_sequences_above_the_cap():
    prox, behav, mask = seq_batch()
    weight, m = compute_correction("mis", prox, behav, mask, cap=2.0, level="sequence")
    assert_weight(weight, [[0, 0, 0], [0.4, 0.4, 0], [1.2, 0, 0], [0, 0, 0]])
    assert close(m["offpolicy/masked_frac"], 5 / 8) and close(m["offpolicy/seq_masked_frac"], 2 / 4)


# T8: length invariance ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [10, 100, 1000])
def test_t8_geometric_ratio_is_length_invariant_and_the_sequence_ratio_is_not(length):
    delta = 0.01
    prox, behav, mask = logprobs_with_ratios([[delta] * length])
    # ρ_geo = e^δ for every length: outside the default [0.999, 1.001], inside [1.01, 1.0101].
    weight, m = compute_correction("geo_rs", prox, behav, mask)
    assert torch.equal(weight, torch.zeros_like(mask)) and close(m["offpolicy/seq_masked_frac"], 1.0)
    assert close(m["offpolicy/is_weight/max"], math.exp(delta))
    weight, _ = compute_correction("geo_rs", prox, behav, mask, low=1.01, high=1.0101)
    assert torch.equal(weight, mask)
    weight, _ = compute_correction("tis", prox, behav, mask, cap=INF, level="sequence")
    torch.testing.assert_close(weight, torch.full_like(mask, math.exp(length * delta)), rtol=1e-12, atol=0)


def test_geo_rs_keeps_or_rejects_whole_sequences_on_both_sides():
    prox, behav, mask = logprobs_with_ratios([[0.0005, -0.0005, None],  # ρ_geo = 1: kept
                                              [0.003, 0.0, None],  # ρ_geo = e^0.0015 > 1.001
                                              [-0.005, 0.001, 0.0]])  # ρ_geo = e^-0.00133 < 0.999
    weight, m = compute_correction("geo_rs", prox, behav, mask)
    assert_weight(weight, [[1, 1, 0], [0, 0, 0], [0, 0, 0]])
    assert close(m["offpolicy/is_weight/frac_high"], 2 / 7) and close(m["offpolicy/is_weight/frac_low"], 3 / 7)
    assert close(m["offpolicy/seq_masked_frac"], 2 / 3)


# K3 rejection ---------------------------------------------------------------------------------------------------
def test_k3_rs_rejects_sequences_whose_mean_k3_exceeds_the_threshold():
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    prox, behav, mask = logprobs_with_ratios([[0.1, -0.1, None, None],  # mean .0050 (sum .01001 would reject)
                                              [0.2, 0.0, None, None],  # mean .0107 > .01
                                              [0.2, 0.0, 0.0, 0.0]])  # same token, longer answer: mean .0054
    weight, m = compute_correction("k3_rs", prox, behav, mask, threshold=0.01)
    assert_weight(weight, [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    seq_k3 = [(k3(0.1) + k3(-0.1)) / 2, k3(0.2) / 2, k3(0.2) / 4]
    assert close(m["offpolicy/seq_k3"], sum(seq_k3) / 3) and close(m["offpolicy/seq_k3/max"], seq_k3[1])
    assert close(m["offpolicy/masked_frac"], 2 / 8) and close(m["offpolicy/seq_masked_frac"], 1 / 3)


# T12: M2PO ------------------------------------------------------------------------------------------------------
def test_t12_m2po_masks_only_the_largest_second_moment_token():
    # Δ² = [1, .01, .01, .01] across two rows: masking index 0 leaves mean .01 < .04.
    prox, behav, mask = logprobs_with_ratios([[1.0, 0.1], [-0.1, 0.1]])
    weight, m = compute_correction("m2po", prox, behav, mask, threshold=0.04)
    assert_weight(weight, [[0.0, math.exp(0.1)], [math.exp(-0.1), math.exp(0.1)]])
    assert close(m["offpolicy/masked_frac"], 0.25) and close(m["offpolicy/m2"], 1.03 / 4)
    assert close(m["offpolicy/kept/m2"], 0.01) and close(m["offpolicy/kept/tokens"], 3)
    assert combine_token_metrics([m])["offpolicy/kept/m2"] == pytest.approx(0.01, abs=1e-12)


def test_m2po_masks_by_size_not_position():
    # Δ² = [.01, .25, .01, .09]: masking .25 leaves mean .11/3 = .0367 < .04; .09 stays.
    prox, behav, mask = logprobs_with_ratios([[0.1, 0.5, -0.1, 0.3]])
    weight, _ = compute_correction("m2po", prox, behav, mask)
    assert_weight(weight, [[math.exp(0.1), 0.0, math.exp(-0.1), math.exp(0.3)]])


def test_m2po_never_masks_every_token():
    prox, behav, mask = logprobs_with_ratios([[1.0, -1.0, None], [1.0, None, None]])
    weight, m = compute_correction("m2po", prox, behav, mask, threshold=1e-3)
    assert int((weight > 0).sum()) == 1 and close(m["offpolicy/masked_frac"], 2 / 3)


def test_m2po_is_batch_global():
    alone = logprobs_with_ratios([[0.3, 0.0]])  # Δ² mean .045 >= .04: the 0.3 token is masked
    assert_weight(compute_correction("m2po", *alone)[0], [[0.0, 1.0]])
    together = logprobs_with_ratios([[0.3, 0.0], [0.0, 0.0], [0.0, 0.0]])  # mean .015: nothing masked
    assert_weight(compute_correction("m2po", *together)[0], [[math.exp(0.3), 1.0], [1, 1], [1, 1]])


# Micro-batching, detach, NaN guards ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [name for name in WEIGHTED if not CORRECTIONS[name].batch_global])
def test_row_wise_corrections_do_not_depend_on_micro_batching(name):
    prox, behav, mask = random_batch(scale=0.05)
    hyper = {"level": "sequence"} if name in ("tis", "mis") else {}
    whole_weight, whole = compute_correction(name, prox, behav, mask, **hyper)
    parts = [compute_correction(name, prox[r], behav[r], mask[r], **hyper) for r in (slice(0, 1), slice(1, 4),
                                                                                        slice(4, 6))]
    torch.testing.assert_close(torch.cat([w for w, _ in parts]), whole_weight, rtol=0, atol=0)
    assert combine_token_metrics([m for _, m in parts]) == pytest.approx(combine_token_metrics([whole]), abs=1e-12)


@pytest.mark.parametrize("name", WEIGHTED)
def test_weights_are_detached(name):
    prox, behav, mask = random_batch()
    prox, behav = prox.clone().requires_grad_(), behav.clone().requires_grad_()
    weight, metrics = compute_correction(name, prox, behav, mask)
    assert not weight.requires_grad and not any(v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("all_masked", [False, True])
def test_garbage_at_masked_positions_and_empty_batches_stay_finite(name, all_masked):
    prox, behav, mask = random_batch()
    if all_masked:
        mask = torch.zeros_like(mask)
    prox = torch.where(mask.bool(), prox, NAN)  # and behav holds -inf there
    weight, metrics = compute_correction(name, prox, behav, mask)
    assert torch.isfinite(weight).all() and torch.equal(weight * (1 - mask), torch.zeros_like(weight))
    assert all(math.isfinite(float(v)) for v in metrics.values())
    combined = combine_token_metrics([metrics])
    assert all(math.isfinite(v) for v in combined.values())
    if all_masked:
        assert combined["offpolicy/is_weight/min"] == 0.0 and combined["offpolicy/tokens"] == 0.0


def test_an_empty_micro_batch_never_wins_the_min_or_max():
    prox, behav, mask = t7_batch()
    _, full = compute_correction("tis", prox, behav, mask)
    _, empty = compute_correction("tis", prox, behav, torch.zeros_like(mask))
    assert float(empty["offpolicy/is_weight/min"]) == EMPTY_MIN
    combined = combine_token_metrics([empty, full])
    assert combined["offpolicy/is_weight/min"] == pytest.approx(0.4)
    assert combined["offpolicy/is_weight/max"] == pytest.approx(10.0)
    assert combined["offpolicy/seq_masked_frac"] == 0.0 and combined["offpolicy/seqs"] == 1.0


# A-3PO ------------------------------------------------------------------------------------------------------------
def test_a3po_interpolates_between_behaviour_and_current_by_version():
    # Learner at v = 5: v_θ = 5, v_prox = 4. Versions 5, 4, 3, 2 -> α = 0, 0, 1/2, 2/3; the last column is a prompt
    # token (version -1, masked) holding garbage.
    behav = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -INF]], dtype=F64)
    current = torch.tensor([[-2.0, -INF, -2.0, -2.0, NAN]], dtype=F64)  # -inf where α = 0 must not give NaN
    versions = torch.tensor([[5, 4, 3, 2, -1]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    prox = approximate_prox_logprobs(current, behav, versions, mask, learner_version=5)
    assert_weight(prox[:, :4], [[-1.0, -1.0, -1.5, -1.0 - 2 / 3]])
    assert prox[0, 4] == -INF  # off-mask: the behaviour logprob, untouched
    assert prox.dtype == F64 and not prox.requires_grad


def test_a3po_is_exact_for_tokens_of_the_proximal_version_and_detached():
    current = torch.randn(2, 3, dtype=F64, requires_grad=True)
    behav = torch.randn(2, 3, dtype=F64)
    prox = approximate_prox_logprobs(current, behav, torch.full((2, 3), 6), torch.ones(2, 3), learner_version=7)
    assert torch.equal(prox, behav) and not prox.requires_grad


# T10: V-trace ----------------------------------------------------------------------------------------------------
def random_trajectories(seed, batch=3, length=6):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    return rand(batch, length), rand(batch, length), rand(batch)  # rewards, values, bootstrap


def n_step_returns(rewards, bootstrap, gamma):
    batch, length = rewards.shape
    out = torch.zeros_like(rewards)
    for s in range(length):
        out[:, s] = sum(gamma ** (t - s) * rewards[:, t] for t in range(s, length)) + gamma ** (length - s) * bootstrap
    return out


def test_t10_on_policy_vtrace_is_the_n_step_return():
    rewards, values, bootstrap = random_trajectories(0)
    discounts = torch.full_like(rewards, 0.9)
    vs, pg = compute_vtrace(torch.zeros_like(rewards), discounts, rewards, values, bootstrap)
    want = n_step_returns(rewards, bootstrap, 0.9)
    torch.testing.assert_close(vs, want, rtol=0, atol=1e-12)
    vs_next = torch.cat([want[:, 1:], bootstrap[:, None]], dim=1)
    torch.testing.assert_close(pg, rewards + 0.9 * vs_next - values, rtol=0, atol=1e-12)
    # Ratios above the clips (ρ̄ = c̄ = 1) are truncated to the on-policy case.
    vs5, pg5 = compute_vtrace(torch.full_like(rewards, 5.0), discounts, rewards, values, bootstrap)
    torch.testing.assert_close(vs5, vs, rtol=0, atol=1e-12)
    torch.testing.assert_close(pg5, pg, rtol=0, atol=1e-12)


def test_t10_a_zero_ratio_cuts_the_trace_and_bootstraps_from_that_state():
    rewards, values, bootstrap = random_trajectories(1)
    discounts = torch.full_like(rewards, 0.9)
    log_rhos = torch.zeros_like(rewards)
    log_rhos[:, 2] = -INF  # ρ_2 = c_2 = 0
    vs, _ = compute_vtrace(log_rhos, discounts, rewards, values, bootstrap)
    torch.testing.assert_close(vs[:, 2], values[:, 2], rtol=0, atol=1e-12)
    torch.testing.assert_close(vs[:, 1], rewards[:, 1] + 0.9 * values[:, 2], rtol=0, atol=1e-12)
    torch.testing.assert_close(vs[:, 0], rewards[:, 0] + 0.9 * rewards[:, 1] + 0.81 * values[:, 2], rtol=0, atol=1e-12)
    later = rewards.clone()
    later[:, 2:] += 100.0
    other_values = values.clone()
    other_values[:, 3:] -= 7.0
    vs_other, _ = compute_vtrace(log_rhos, discounts, later, other_values, bootstrap + 3.0)
    torch.testing.assert_close(vs_other[:, :3], vs[:, :3], rtol=0, atol=1e-12)  # nothing from t >= 2 leaks in


def brute_force_vtrace(log_rhos, discounts, rewards, values, bootstrap, clip_rho, clip_pg_rho, clip_c):
    """v_s = V_s + Σ_{t>=s} (Π_{i=s}^{t-1} γ_i c_i) δ_t, literally, one sequence and one s at a time."""
    clip = lambda x, c: x if c is None else min(x, c)  # noqa: E731
    batch, length = rewards.shape
    vs, pg = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for b in range(batch):
        rho = [math.exp(float(x)) for x in log_rhos[b]]
        v = [float(x) for x in values[b]] + [float(bootstrap[b])]
        delta = [clip(rho[t], clip_rho) * (float(rewards[b, t]) + float(discounts[b, t]) * v[t + 1] - v[t])
                 for t in range(length)]
        for s in range(length):
            total, trace = v[s], 1.0
            for t in range(s, length):
                total += trace * delta[t]
                trace *= float(discounts[b, t]) * clip(rho[t], clip_c)
            vs[b, s] = total
        for s in range(length):
            v_next = float(vs[b, s + 1]) if s + 1 < length else float(bootstrap[b])
            pg[b, s] = clip(rho[s], clip_pg_rho) * (float(rewards[b, s]) + float(discounts[b, s]) * v_next - v[s])
    return vs, pg


@pytest.mark.parametrize("seed", range(6))
def test_t10_vtrace_matches_the_brute_force_sum_formula(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    rewards, values, bootstrap = random_trajectories(seed, batch=4, length=7)
    log_rhos = torch.randn(4, 7, generator=gen, dtype=F64)
    discounts = torch.where(torch.rand(4, 7, generator=gen) < 0.15, 0.0, 0.9).to(F64)  # some episode ends
    clips = [None if seed == 5 else float(x) for x in 0.5 + 1.5 * torch.rand(3, generator=gen, dtype=F64)]
    vs, pg = compute_vtrace(log_rhos, discounts, rewards, values, bootstrap,
                            clip_rho=clips[0], clip_pg_rho=clips[1], clip_c=clips[2])
    want_vs, want_pg = brute_force_vtrace(log_rhos, discounts, rewards, values, bootstrap, *clips)
    torch.testing.assert_close(vs, want_vs, rtol=0, atol=1e-10)
    torch.testing.assert_close(pg, want_pg, rtol=0, atol=1e-10)


# V-trace for LLM batches -------------------------------------------------------------------------------------------
def test_critic_free_on_policy_vtrace_gives_the_sequence_reward_on_every_token():
    prox, _, mask = random_batch()
    mask[1, 2] = 0.0  # a masked token inside a trajectory (tool output) is skipped, not a step
    rewards = torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0, -1.0], dtype=F64)
    adv = compute_vtrace_advantages(prox, prox.clone(), mask, rewards)
    torch.testing.assert_close(adv, rewards[:, None] * mask, rtol=0, atol=1e-12)


def test_on_policy_vtrace_with_values_gives_reward_minus_value():
    prox, _, mask = random_batch()
    values = torch.randn(prox.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    rewards = torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0, -1.0], dtype=F64)
    adv = compute_vtrace_advantages(prox, prox.clone(), mask, rewards, torch.where(mask.bool(), values, NAN))
    torch.testing.assert_close(adv, (rewards[:, None] - values) * mask, rtol=0, atol=1e-12)


def test_off_policy_vtrace_advantages_hand_computed_with_masked_gaps():
    # Steps at positions 0, 2, 3 with ρ = .5, 2, .25 (c = ρ̄ clip = .5, 1, .25), R = 4, V = 0:
    # v_2 = .25·4 = 1, v_1 = 1·v_2 = 1, v_0... A_s = ρpg_s (r_s + v_{s+1}): [.5·1, 1·1, .25·4] = [.5, 1, 1].
    prox, behav, mask = logprobs_with_ratios([[math.log(0.5), None, math.log(2), math.log(0.25), None]])
    prox[0, 1], behav[0, 4] = NAN, NAN
    adv = compute_vtrace_advantages(prox, behav, mask, torch.tensor([4.0], dtype=F64))
    assert_weight(adv, [[0.5, 0.0, 1.0, 1.0, 0.0]])


def test_vtrace_advantages_of_an_all_masked_row_are_zero():
    prox, behav, mask = random_batch()  # row 2 has no valid token
    adv = compute_vtrace_advantages(prox, behav, mask, torch.ones(6, dtype=F64))
    assert torch.isfinite(adv).all() and torch.equal(adv[2], torch.zeros(6, dtype=F64))


# Metrics ------------------------------------------------------------------------------------------------------------
def test_offpolicy_metrics_hand_computed():
    # ρ = [2, 1] on sequence 0 and [0.5] on sequence 1; the rest is padding.
    behav = torch.tensor([[-1.0, -2.0], [-0.5, -INF]], dtype=F64)
    log_rho = torch.tensor([[math.log(2), 0.0], [-math.log(2), 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    m = compute_offpolicy_metrics(behav + log_rho, behav, mask)
    ln2 = math.log(2)
    want = {
        "mismatch_k1": 0.0, "mismatch_k3": ((1 - ln2) + (ln2 - 0.5)) / 3, "abs_diff": 2 * ln2 / 3,
        "abs_diff/max": ln2, "tis_abs": 0.5, "chi2_token": (4 + 1 + 0.25) / 3 - 1, "chi2_seq": (4 + 0.25) / 2 - 1,
        "ess": 3.5 ** 2 / (3 * 5.25),
        "ppl_prox": (math.exp(-((-1 + ln2) + -2) / 2) + math.exp(0.5 + ln2)) / 2,
        "ppl_behav": (math.exp(1.5) + math.exp(0.5)) / 2,
        "log_ppl_diff": (-ln2 / 2 + ln2) / 2, "ppl_ratio": (2 ** -0.5 + 2) / 2,
    }
    assert set(m) == {f"offpolicy/{k}" for k in want}
    for key, value in want.items():
        assert m[f"offpolicy/{key}"] == pytest.approx(value, abs=1e-12), key


def test_chi2_seq_clamps_the_log_ratio_sum():
    prox, behav, mask = logprobs_with_ratios([[15.0, 15.0]])
    assert compute_offpolicy_metrics(prox, behav, mask)["offpolicy/chi2_seq"] == pytest.approx(math.exp(40) - 1)


def test_offpolicy_metrics_are_finite_with_garbage_and_trivial_when_nothing_is_valid():
    prox, behav, mask = random_batch()
    prox = torch.where(mask.bool(), prox, NAN)
    assert all(math.isfinite(v) for v in compute_offpolicy_metrics(prox, behav, mask).values())
    assert compute_offpolicy_metrics(prox, behav, torch.zeros_like(mask)) == EMPTY_OFFPOLICY_METRICS


def test_staleness_metrics_histogram_and_multi_version_sequences():
    versions = torch.tensor([[5, 5, 4], [3, 3, 9], [2, 4, -1], [-1, -1, -1]])  # the 9 is masked garbage
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [0, 0, 0]])
    m = compute_staleness_metrics(versions, mask, learner_version=5, max_staleness=2)
    # staleness: [0, 0, 1], [2, 2], [3, 1] -> 7 tokens, one of them above η = 2.
    assert m == pytest.approx({
        "offpolicy/staleness/mean": 9 / 7, "offpolicy/staleness/max": 3.0, "offpolicy/staleness/min": 0.0,
        "offpolicy/staleness/hist/0": 2 / 7, "offpolicy/staleness/hist/1": 2 / 7, "offpolicy/staleness/hist/2": 2 / 7,
        "offpolicy/staleness/frac_above_max": 1 / 7, "offpolicy/staleness/multi_version_seq_frac": 2 / 3,
    }, abs=1e-12)
    empty = compute_staleness_metrics(versions, torch.zeros_like(mask), learner_version=5, max_staleness=2)
    assert all(v == 0.0 for v in empty.values()) and "offpolicy/staleness/hist/2" in empty


@pytest.mark.parametrize("bad_version", [6, -1])
def test_staleness_metrics_reject_tokens_outside_the_version_convention(bad_version):
    with pytest.raises(ValueError, match="versions"):
        compute_staleness_metrics(torch.tensor([[5, bad_version]]), torch.ones(1, 2), learner_version=5,
                                  max_staleness=2)


def test_combine_divides_sequence_and_kept_means_by_their_own_counts():
    combined = combine_token_metrics([
        {"offpolicy/tokens": 4.0, "offpolicy/seqs": 2.0, "offpolicy/seq_masked_frac_sum": 1.0,
         "offpolicy/masked_frac_sum": 1.0, "offpolicy/kept/tokens": 3.0, "offpolicy/kept/m2_sum": 0.3,
         "offpolicy/is_weight/min": 0.5, "offpolicy/is_weight/mean_sum": 4.0, "offpolicy/is_weight/sq_mean_sum": 5.0,
         "offpolicy/is_weight/std": 123.0, "offpolicy/is_weight/ess": 123.0},
        {"offpolicy/tokens": 2.0, "offpolicy/seqs": 1.0, "offpolicy/seq_masked_frac_sum": 0.0,
         "offpolicy/masked_frac_sum": 0.0, "offpolicy/kept/tokens": 2.0, "offpolicy/kept/m2_sum": 0.2,
         "offpolicy/is_weight/min": 0.25, "offpolicy/is_weight/mean_sum": 2.0, "offpolicy/is_weight/sq_mean_sum": 7.0},
    ])
    assert combined["offpolicy/seq_masked_frac"] == pytest.approx(1 / 3)
    assert combined["offpolicy/masked_frac"] == pytest.approx(1 / 6)
    assert combined["offpolicy/kept/m2"] == pytest.approx(0.1)
    assert combined["offpolicy/is_weight/min"] == 0.25
    assert combined["offpolicy/is_weight/std"] == pytest.approx(math.sqrt(2 - 1))  # sq_mean 12/6, mean 6/6
    assert combined["offpolicy/is_weight/ess"] == pytest.approx(1 / 2)


# The rejection-sampling family ----------------------------------------------------------------------------------
def test_rs_judges_tokens_or_sequences_by_k1_k2_or_k3_with_mean_sum_or_max():
    prox, behav, mask = logprobs_with_ratios([[0.2, -0.1, None], [0.05, 0.05, 0.05], [-0.3, None, None]])
    k2 = lambda x: x * x / 2  # noqa: E731
    # token k1 in [-0.2, 0.1]: rejects 0.2 and -0.3
    weight, m = compute_correction("rs", prox, behav, mask, level="token", stat="k1", low=-0.2, high=0.1)
    assert_weight(weight, [[0, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert close(m["offpolicy/masked_frac"], 2 / 6) and close(m["offpolicy/rs_stat/max"], 0.2)
    # sequence sum of k1: 0.1, 0.15, -0.3 against high 0.12 -> row 2 rejected; low -0.2 -> row 3 too
    weight, _ = compute_correction("rs", prox, behav, mask, stat="k1", agg="sum", low=-0.2, high=0.12)
    assert_weight(weight, [[1, 1, 0], [0, 0, 0], [0, 0, 0]])
    # sequence max of k2: 0.02, 0.00125, 0.045 against high 0.03, kept tokens weighted by ρ(y)
    weight, m = compute_correction("rs", prox, behav, mask, stat="k2", agg="max", high=0.03, weight="ratio")
    assert_weight(weight, [[math.exp(0.1)] * 2 + [0], [math.exp(0.15)] * 3, [0, 0, 0]])
    assert close(m["offpolicy/rs_stat/max"], k2(-0.3)) and close(m["offpolicy/rs_stat"], (0.02 + 0.00125 + 0.045) / 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_named_masks_are_points_of_the_rs_family(seed):
    prox, behav, mask = random_batch(seed, scale=0.05)
    pairs = [(("geo_rs", {"low": 0.98, "high": 1.02}),
              {"stat": "k1", "agg": "mean", "low": math.log(0.98), "high": math.log(1.02)}),
             (("k3_rs", {"threshold": 0.0015}), {"stat": "k3", "agg": "mean", "high": 0.0015}),
             (("icepop", {"low": 0.95, "high": 1.05}),
              {"level": "token", "stat": "k1", "low": math.log(0.95), "high": math.log(1.05), "weight": "ratio"}),
             (("seq_mis", {"cap": 1.03}),
              {"stat": "k1", "agg": "sum", "low": -math.log(1.03), "high": math.log(1.03), "weight": "ratio"})]
    for (name, hyper), family in pairs:
        named = compute_correction(name, prox, behav, mask, **hyper)[0]
        general = compute_correction("rs", prox, behav, mask, **family)[0]
        torch.testing.assert_close(named, general, rtol=1e-12, atol=0, msg=name)
        assert 0 < (named > 0).sum() < mask.sum(), name  # the setting keeps some tokens and rejects some


def test_seq_mis_keeps_a_two_sided_window_of_sequence_ratios():
    prox, behav, mask = seq_batch()  # ρ(y) = 3, 0.4, 1.2, e^20
    weight, m = compute_correction("seq_mis", prox, behav, mask)
    assert_weight(weight, [[0, 0, 0], [0, 0, 0], [1.2, 0, 0], [0, 0, 0]])  # 0.4 < 1/2 is dropped, unlike mis
    assert close(m["offpolicy/seq_masked_frac"], 3 / 4)
    weight, _ = compute_correction("seq_mis", prox, behav, mask, cap=4.0, low=0.3)
    assert_weight(weight, [[3, 3, 0], [0.4, 0.4, 0], [1.2, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("hyper, match", [({"stat": "k4"}, "stat"), ({"low": None, "high": None}, "a bound"),
                                          ({"low": 0.2, "high": 0.1}, "low < high"), ({"agg": "median"}, "agg")])
def test_rs_refuses_settings_that_reject_nothing_or_do_not_exist(hyper, match):
    prox, behav, mask = seq_batch()
    with pytest.raises(ValueError, match=match):
        compute_correction("rs", prox, behav, mask, **hyper)


# Self-normalised IS -----------------------------------------------------------------------------------------------
def test_batch_normalisation_makes_the_weights_average_one_over_tokens_or_sequences():
    from asyncrl.algos.corrections import normalize_batch_weight

    mask = t_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=F64)
    weight = torch.tensor([[2.0, 0.0, 9.0], [1.0, 7.0, 7.0], [5.0, 5.0, 5.0]], dtype=F64)  # garbage off-mask
    normed, m = normalize_batch_weight(weight, t_mask, "token")  # mean over 3 valid tokens: 1
    assert_weight(normed, [[2.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0, 0, 0]])
    assert close(m["offpolicy/batch_norm_factor"], 1.0)
    normed, m = normalize_batch_weight(weight * 4, mask, "token")
    assert_weight(normed, [[2.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0, 0, 0]]) and close(m["offpolicy/batch_norm_factor"],
                                                                                  0.25)
    seq = torch.tensor([[3.0, 3.0, 0.0], [1.0, 0.0, 0.0], [0, 0, 0]], dtype=F64)  # ρ(y) = 3 and 1: mean 2
    normed, m = normalize_batch_weight(seq, mask, "sequence")
    assert_weight(normed, [[1.5, 1.5, 0.0], [0.5, 0.0, 0.0], [0, 0, 0]]) and close(m["offpolicy/batch_norm_factor"],
                                                                                  0.5)
    zero, _ = normalize_batch_weight(torch.zeros(3, 3, dtype=F64), mask, "token")  # all rejected: left alone
    assert torch.equal(zero, torch.zeros(3, 3, dtype=F64))
