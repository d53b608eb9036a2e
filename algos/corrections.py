"""Off-policy corrections: the detached per-token weight that multiplies any policy loss
(docs/algorithms.md §2.2-2.6, docs/architecture.md §5).

A correction is chosen independently of the loss: it only produces ``is_weight`` [B, T] (or None), which every loss
reads from its ``PolicyLossInputs``. Keeping the two apart is what guarantees nothing is corrected twice. Every
weight here is a function of ρ_t = π_prox / π_behav = exp(ℓprox_t - ℓμ_t), where π_prox is the learner's step-start
policy (recomputed, or A-3PO's ``approximate_prox_logprobs``) and μ the generator that sampled the token:

| name      | weight on a valid token                                  | source                                    |
|-----------|----------------------------------------------------------|-------------------------------------------|
| none      | no weight (on-policy, or bypass mode where prox := μ)    |                                           |
| decoupled | min(ρ_t, cap) or ρ_t·1[ρ_t <= cap]                       | AReaL decoupled PPO, cap 5                |
| tis       | min(ρ, cap), ρ = ρ_t or ρ(y) = Π_t ρ_t                   | TIS blog; verl rollout_is, threshold 2    |
| mis       | ρ·1[ρ <= cap], token or sequence                         | Liu/Li "When Speed Kills Stability"       |
| geo_rs    | 1 if low <= ρ_geo(y) <= high else 0                      | verl decoupled_geo_rs, 0.999_1.001        |
| k3_rs     | 1 if mean_t(ρ_t - 1 - log ρ_t) <= threshold else 0       | verl decoupled_k3_rs, 0.01                |
| icepop    | ρ_t if low <= ρ_t <= high else 0                         | Ring-1T IcePop, [0.5, 5]                  |
| m2po      | ρ_t, 0 on the tokens masked by the second-moment rule    | M2PO paper / AReaL, τ 0.04                |
| rs        | 1 (or ρ) unless a k1/k2/k3 statistic leaves [low, high]  | verl rollout_rs family (see below)        |
| seq_mis   | ρ(y) if 1/cap <= ρ(y) <= cap else 0                      | verl seq_is_rs / MIS preset, cap 2        |

``rs`` is the rejection-sampling family the named masks are points of: a per-token statistic of log ρ_t (k1 = log ρ,
k2 = (log ρ)²/2, k3 = ρ - 1 - log ρ), compared per token or aggregated over the sequence (mean, sum or max), against
optional bounds; a kept token weighs 1 or its ratio (ρ_t, or ρ(y) at sequence level). geo_rs is rs(sequence, k1,
mean, [log low, log high]); k3_rs is rs(sequence, k3, mean, high = threshold); icepop is rs(token, k1,
[log low, log high], weight ratio); seq_mis is rs(sequence, k1, sum, [log 1/cap, log cap], weight ratio). The named
ones keep their own functions (and their published bounds in ratio space); tests check that each equals its rs
setting.

Why several: token-level weights ignore that the state (the prefix) was also drawn from μ, so they are biased by
O(T²Δ); the sequence ratio is unbiased but its variance grows like (1 + χ²)^T; the geometric mean and K3 criteria are
length-invariant, so long answers are not rejected just for being long. Truncation (tis) keeps every token with a
bounded weight; masking (mis, icepop, rs, m2po) drops the toxic tail entirely. Rejected tokens keep their place in
``loss_mask``, so the loss normaliser still counts them (AReaL/slime; §1.15).

Numerics: log ρ_t is ``log_ratio.masked_log_ratio`` (fp32 at least, -inf - -inf at padding never reaches
arithmetic, a NaN on a valid token is treated as 0 as in AReaL, clamped to ±20), and |Σ_t log ρ_t| is clamped to the
same ``LOG_RATIO_CLAMP`` before exp. Every weight is computed under no_grad: a gradient through w would add a
log π·∇w bias term (§4.5).

Metrics follow ``losses.py`` / ``metrics.combine_token_metrics``: ``offpolicy/tokens`` and ``offpolicy/seqs``
counts, ``<name>_sum`` numerators with their means, ``/max`` and ``/min``. The ``offpolicy/is_weight/*`` statistics
describe the weight the correction computes BEFORE truncation or rejection (ρ_t for token-level corrections, ρ(y)
for sequence-level ones, ρ_geo for geo_rs), so they show how off-policy the data really was. ``std`` and ``ess``
(Kish ESS / N) describe one call; ``combine_token_metrics`` recomputes them from the combined ``mean`` and
``sq_mean``. V-trace is not a weight but an advantage estimator: ``algos/vtrace.py`` (re-exported here).
``CORRECTION_WEIGHTS`` (name -> weight function) is built from ``registry.CORRECTIONS``, whose entries also say
which corrections are batch-global (m2po: call it once on the whole step's batch, never per micro-batch).
"""
from collections.abc import Callable

import torch
from torch import Tensor

from asyncrl.algos.log_ratio import LOG_RATIO_CLAMP, masked_log_ratio
from asyncrl.algos.registry import CORRECTIONS, NO_WEIGHT, keyword_defaults
from asyncrl.algos.vtrace import compute_vtrace, compute_vtrace_advantages  # noqa: F401  (V-trace lives there)

EMPTY_MIN = float(torch.exp(torch.tensor(LOG_RATIO_CLAMP, dtype=torch.float64)))
"""``/min`` of a call with no valid token: the largest ratio the clamp allows, so it never wins the min across
micro-batches while staying finite (``combine_token_metrics`` reports 0 when no call saw a token)."""

IS_WEIGHT_MODES = ("truncate", "mask")
LEVELS = ("token", "sequence")
RS_STATS = ("k1", "k2", "k3")
RS_AGGS = ("mean", "sum", "max")
RS_WEIGHTS = ("one", "ratio")


# Shared pieces ------------------------------------------------------------------------------------------------
def _token_log_ratio(logprobs_prox: Tensor, logprobs_behav: Tensor, valid: Tensor) -> Tensor:
    """log ρ_t [B, T], detached: ``masked_log_ratio`` of the two policies (clamped, 0 off-mask, fp32 at least)."""
    return masked_log_ratio(logprobs_prox.detach(), logprobs_behav.detach(), valid)


def _sequence_log_ratio(log_ratio: Tensor, valid: Tensor, *, geometric: bool) -> Tensor:
    """[B]: log ρ(y) = Σ_t log ρ_t (clamped to ±20), or log ρ_geo(y) = that sum / |y| when ``geometric``."""
    total = log_ratio.sum(dim=-1)  # [B]; log_ratio is already 0 off-mask
    if geometric:
        return total / valid.sum(dim=-1).clamp(min=1).to(total.dtype)
    return total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _raw_weight(log_ratio: Tensor, valid: Tensor, level: str) -> Tensor:
    """[B, T] weight before bounding: ρ_t per token, or the sequence ratio ρ(y) broadcast to the sequence's tokens."""
    if level not in LEVELS:
        raise ValueError(f"unknown correction level {level!r}; choose one of {LEVELS}")
    if level == "token":
        return torch.exp(log_ratio)
    return torch.exp(_sequence_log_ratio(log_ratio, valid, geometric=False))[:, None].expand_as(log_ratio)


def _add_mean(metrics: dict, name: str, total: Tensor, count: Tensor) -> None:
    metrics[f"{name}_sum"] = total
    metrics[name] = total / count.clamp(min=1.0)


def _weight_metrics(
    raw: Tensor,
    valid: Tensor,
    *,
    truncated: Tensor | None = None,
    masked: Tensor | None = None,
    low: float | None = None,
    high: float | None = None,
) -> dict[str, Tensor]:
    """Statistics of the raw weight over valid tokens, and the fractions truncated / masked / outside [low, high]."""
    zeros = torch.zeros_like(raw)
    tokens = valid.sum().to(raw.dtype)
    row_tokens = valid.sum(dim=-1)  # [B]
    seqs = (row_tokens > 0).sum().to(raw.dtype)
    raw_valid = torch.where(valid, raw, zeros)  # [B, T]
    metrics = {"offpolicy/tokens": tokens, "offpolicy/seqs": seqs}
    _add_mean(metrics, "offpolicy/is_weight/mean", raw_valid.sum(), tokens)
    _add_mean(metrics, "offpolicy/is_weight/sq_mean", (raw_valid * raw_valid).sum(), tokens)
    mean, sq_mean = metrics["offpolicy/is_weight/mean"], metrics["offpolicy/is_weight/sq_mean"]
    # Derived, for a single call; combine_token_metrics recomputes both from the combined mean and sq_mean.
    metrics["offpolicy/is_weight/std"] = (sq_mean - mean * mean).clamp(min=0.0).sqrt()
    metrics["offpolicy/is_weight/ess"] = torch.where(sq_mean > 0, mean * mean / sq_mean.clamp(min=1e-30), 1.0)
    per_seq_mean = raw_valid.sum(dim=-1) / row_tokens.clamp(min=1).to(raw.dtype)  # [B], 0 for empty rows
    _add_mean(metrics, "offpolicy/is_weight/seq_mean", per_seq_mean.sum(), seqs)
    # Weights are positive: 0 never wins a max; e^20 never wins a min (see EMPTY_MIN).
    metrics["offpolicy/is_weight/max"] = raw_valid.max() if raw.numel() else zeros.sum()
    metrics["offpolicy/is_weight/min"] = (torch.where(valid, raw, torch.full_like(raw, EMPTY_MIN)).min()
                                          if raw.numel() else zeros.sum() + EMPTY_MIN)
    none = torch.zeros_like(valid)
    truncated = valid & (none if truncated is None else truncated)
    masked = valid & (none if masked is None else masked)
    _add_mean(metrics, "offpolicy/truncated_frac", truncated.sum().to(raw.dtype), tokens)
    _add_mean(metrics, "offpolicy/masked_frac", masked.sum().to(raw.dtype), tokens)
    _add_mean(metrics, "offpolicy/seq_masked_frac", masked.any(dim=-1).sum().to(raw.dtype), seqs)
    if high is not None:
        _add_mean(metrics, "offpolicy/is_weight/frac_high", (valid & (raw > high)).sum().to(raw.dtype), tokens)
    if low is not None:
        _add_mean(metrics, "offpolicy/is_weight/frac_low", (valid & (raw < low)).sum().to(raw.dtype), tokens)
    return metrics


def _capped(raw: Tensor, valid: Tensor, *, cap: float, mask: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncate (min(w, cap)) or mask (w·1[w <= cap]) a raw weight; frac_high/low are w > cap and w < 1/cap."""
    if cap <= 0:
        raise ValueError(f"correction cap must be > 0, got {cap}")
    above = valid & (raw > cap)  # [B, T]
    weight = torch.where(above, torch.zeros_like(raw) if mask else torch.full_like(raw, cap), raw)
    weight = torch.where(valid, weight, torch.zeros_like(weight))
    metrics = _weight_metrics(raw, valid, truncated=None if mask else above, masked=above if mask else None,
                              low=1.0 / cap, high=cap)
    return weight, metrics


def _check_bounds(low: float, high: float) -> None:
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")


# The corrections ----------------------------------------------------------------------------------------------
def decoupled_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, cap: float = 5.0, mode: str = "truncate"
) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled-PPO weight w = π_prox / π_behav, bounded at ``cap``.

    It moves samples drawn from the stale generator onto the learner's step-start policy, while the loss's own
    ratio u = π_θ / π_prox keeps the trust region centred on π_prox. ``truncate``: min(w, cap) (biased, low
    variance); ``mask``: w·1[w <= cap] (AReaL's behave_imp_weight_cap, whose mode defaults to token mask there).
    cap = 5.0 is AReaL's long-standing behave_imp_weight_cap.
    """
    if mode not in IS_WEIGHT_MODES:
        raise ValueError(f"unknown is_weight mode {mode!r}; choose one of {IS_WEIGHT_MODES}")
    valid = loss_mask.bool()  # [B, T]
    raw = torch.exp(_token_log_ratio(logprobs_prox, logprobs_behav, valid))  # [B, T]
    return _capped(raw, valid, cap=cap, mask=mode == "mask")


def tis_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, cap: float = 2.0, level: str = "token"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated IS (Yao, Liu et al.): w = min(ρ, cap) with ρ = ρ_t (token) or ρ(y) = Π_t ρ_t (sequence).

    Token level is verl's default (rollout_is="token", threshold 2.0; slime --tis-clip 2.0). Sequence level is
    unbiased as cap -> ∞ but its variance grows exponentially with length, so it needs the cap.
    """
    valid = loss_mask.bool()
    raw = _raw_weight(_token_log_ratio(logprobs_prox, logprobs_behav, valid), valid, level)
    return _capped(raw, valid, cap=cap, mask=False)


def mis_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, cap: float = 2.0, level: str = "token"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked IS (Liu/Li): w = ρ·1[ρ <= cap], token or sequence level: a hard trust region that drops the toxic
    tail instead of keeping it at weight ``cap``. cap 2.0 as TIS (verl's threshold); level defaults to token."""
    valid = loss_mask.bool()
    raw = _raw_weight(_token_log_ratio(logprobs_prox, logprobs_behav, valid), valid, level)
    return _capped(raw, valid, cap=cap, mask=True)


def geo_rs_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, low: float = 0.999, high: float = 1.001
) -> tuple[Tensor, dict[str, Tensor]]:
    """Geometric-mean rejection sampling: keep sequence y iff low <= ρ_geo(y) = exp(mean_t log ρ_t) <= high.

    Weight 1 on kept sequences, 0 on rejected ones (pure rejection, no reweighting). ρ_geo is length-invariant, so
    the criterion does not reject long answers for their length. Bounds: verl's decoupled_geo_rs "0.999_1.001".
    """
    _check_bounds(low, high)
    valid = loss_mask.bool()
    log_ratio = _token_log_ratio(logprobs_prox, logprobs_behav, valid)
    rho_geo = torch.exp(_sequence_log_ratio(log_ratio, valid, geometric=True))[:, None].expand_as(log_ratio)
    rejected = valid & ((rho_geo < low) | (rho_geo > high))  # [B, T], whole rows
    weight = torch.where(valid & ~rejected, torch.ones_like(rho_geo), torch.zeros_like(rho_geo))
    return weight, _weight_metrics(rho_geo, valid, masked=rejected, low=low, high=high)


def k3_rs_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, threshold: float = 0.01
) -> tuple[Tensor, dict[str, Tensor]]:
    """K3 rejection sampling: keep sequence y iff mean_t(ρ_t - 1 - log ρ_t) <= threshold, weight 1 / 0.

    The per-token term is ≥ 0 and estimates KL(μ || π_prox) on μ's samples, so its mean is a length-invariant
    divergence of the sequence. threshold 0.01: verl's decoupled_k3_rs preset.
    """
    if threshold <= 0:
        raise ValueError(f"k3_rs threshold must be > 0, got {threshold}")
    valid = loss_mask.bool()
    log_ratio = _token_log_ratio(logprobs_prox, logprobs_behav, valid)
    k3 = torch.expm1(log_ratio) - log_ratio  # [B, T], 0 off-mask; expm1 avoids cancellation near ρ = 1
    row_tokens = valid.sum(dim=-1)
    seq_k3 = k3.sum(dim=-1) / row_tokens.clamp(min=1).to(k3.dtype)  # [B]
    rejected = valid & (seq_k3 > threshold)[:, None]
    weight = torch.where(valid & ~rejected, torch.ones_like(k3), torch.zeros_like(k3))
    metrics = _weight_metrics(torch.exp(log_ratio), valid, masked=rejected)
    _add_mean(metrics, "offpolicy/seq_k3", seq_k3.sum(), metrics["offpolicy/seqs"])
    metrics["offpolicy/seq_k3/max"] = seq_k3.max() if seq_k3.numel() else k3.sum()
    return weight, metrics


def icepop_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, low: float = 0.5, high: float = 5.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop (Ring-1T): w = ρ_t if low <= ρ_t <= high else 0, a double-sided token mask: both tokens the learner
    finds far less likely and far more likely than the sampler lose their gradient. [0.5, 5]: the paper's α, β."""
    _check_bounds(low, high)
    valid = loss_mask.bool()
    raw = torch.exp(_token_log_ratio(logprobs_prox, logprobs_behav, valid))
    masked = valid & ((raw < low) | (raw > high))
    weight = torch.where(valid & ~masked, raw, torch.zeros_like(raw))
    return weight, _weight_metrics(raw, valid, masked=masked, low=low, high=high)


def _m2po_masked(delta_sq: Tensor, threshold: float) -> Tensor:
    """[N] bool: mask the largest Δ² until the mean of the rest is < threshold; always keep at least one token."""
    n = delta_sq.numel()
    sorted_sq, order = torch.sort(delta_sq.double(), descending=True, stable=True)
    suffix_mean = sorted_sq.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=torch.float64,
                                                                     device=delta_sq.device)
    below = suffix_mean < threshold  # [N]: keeping sorted tokens i.. satisfies the bound
    num_masked = torch.where(below.any(), below.int().argmax(), torch.tensor(n - 1, device=delta_sq.device))
    masked_sorted = torch.arange(n, device=delta_sq.device) < num_masked
    masked = torch.empty_like(masked_sorted)
    masked[order] = masked_sorted
    return masked


def m2po_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, threshold: float = 0.04
) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO (Zheng et al. 2025, arXiv 2510.01161): bound the second moment M2 = mean(Δ²), Δ = ℓprox - ℓμ, by masking
    the tokens with the largest Δ² until the mean over the remaining tokens is < threshold (never all of them).
    Weight ρ_t on kept tokens, 0 on masked ones. BATCH-GLOBAL: call it once on the whole step's batch.

    This is the paper's equation and AReaL's ``_apply_m2po_masking`` (which uses (ℓμ - ℓprox)², the same square).
    The official repo instead solves for an adaptive τ and clamps the ratio to [e^-τ, e^τ] on "harmful" tokens; that
    variant was not chosen because it is a loss-side clip, which would double-count with the loss's own trust
    region (our corrections only weight tokens), and because the mask is what the paper writes and AReaL ships.
    threshold 0.04: τ_M2 of every paper experiment ("not sensitive") and AReaL's gsm8k_m2po.yaml.
    """
    if threshold <= 0:
        raise ValueError(f"m2po threshold must be > 0, got {threshold}")
    valid = loss_mask.bool()
    log_ratio = _token_log_ratio(logprobs_prox, logprobs_behav, valid)
    delta_sq = log_ratio * log_ratio  # [B, T], 0 off-mask
    masked = torch.zeros_like(valid)
    if valid.any():
        masked[valid] = _m2po_masked(delta_sq[valid], threshold)
    raw = torch.exp(log_ratio)
    weight = torch.where(valid & ~masked, raw, torch.zeros_like(raw))
    metrics = _weight_metrics(raw, valid, masked=masked)
    _add_mean(metrics, "offpolicy/m2", delta_sq.sum(), metrics["offpolicy/tokens"])
    kept = valid & ~masked
    metrics["offpolicy/kept/tokens"] = kept.sum().to(raw.dtype)
    _add_mean(metrics, "offpolicy/kept/m2", torch.where(kept, delta_sq, 0.0).sum(), metrics["offpolicy/kept/tokens"])
    return weight, metrics


def _token_statistic(log_ratio: Tensor, stat: str) -> Tensor:
    """[B, T] per-token statistic of log ρ_t: k1 = log ρ, k2 = (log ρ)²/2, k3 = ρ - 1 - log ρ (≥ 0, expm1)."""
    if stat == "k1":
        return log_ratio
    if stat == "k2":
        return 0.5 * log_ratio * log_ratio
    return torch.expm1(log_ratio) - log_ratio


def _rs_statistic(log_ratio: Tensor, valid: Tensor, *, level: str, stat: str, agg: str) -> Tensor:
    """[B, T]: the statistic each token is judged by, its own (token level) or its sequence's aggregate broadcast."""
    per_token = torch.where(valid, _token_statistic(log_ratio, stat), torch.zeros_like(log_ratio))
    if level == "token":
        return per_token
    count = valid.sum(dim=-1).clamp(min=1).to(per_token.dtype)  # [B]
    if agg == "mean":
        per_seq = per_token.sum(dim=-1) / count
    elif agg == "sum":
        per_seq = per_token.sum(dim=-1)
    else:
        per_seq = torch.where(valid, per_token, torch.full_like(per_token, -torch.inf)).amax(dim=-1)
        per_seq = torch.where(valid.any(dim=-1), per_seq, torch.zeros_like(per_seq))
    return per_seq[:, None].expand_as(per_token)


def rejection_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, level: str = "sequence", stat: str = "k3",
    agg: str = "mean", low: float | None = None, high: float | None = 0.01, weight: str = "one"
) -> tuple[Tensor, dict[str, Tensor]]:
    """The rejection-sampling family (verl's rollout_rs modes: token_k1, seq_mean_k3, seq_max_k2, ...): a token is
    rejected (weight 0) when its statistic (``stat`` of log ρ_t, per token or aggregated over its sequence with
    ``agg``) is below ``low`` or above ``high`` (None: unbounded on that side); a kept token weighs 1 (``one``) or
    its ratio (``ratio``: ρ_t, or ρ(y) at sequence level). Defaults are k3_rs's: sequence, k3, mean, above 0.01.
    ``offpolicy/rs_stat`` (mean over sequences at sequence level, over tokens at token level) and its ``/max``
    say how far the data was from the bounds."""
    for name, value, allowed in (("level", level, LEVELS), ("stat", stat, RS_STATS), ("agg", agg, RS_AGGS),
                                 ("weight", weight, RS_WEIGHTS)):
        if value not in allowed:
            raise ValueError(f"rs {name} must be one of {allowed}, got {value!r}")
    if low is None and high is None:
        raise ValueError("rs needs a bound (low, high or both): without one it rejects nothing")
    if low is not None and high is not None and not low < high:
        raise ValueError(f"rs needs low < high, got low={low}, high={high}")
    valid = loss_mask.bool()
    log_ratio = _token_log_ratio(logprobs_prox, logprobs_behav, valid)
    value = _rs_statistic(log_ratio, valid, level=level, stat=stat, agg=agg)  # [B, T]
    outside = torch.zeros_like(valid)
    if low is not None:
        outside = outside | (value < low)
    if high is not None:
        outside = outside | (value > high)
    rejected = valid & outside
    raw = _raw_weight(log_ratio, valid, level)  # ρ_t or ρ(y): the metrics, and the kept weight with `ratio`
    kept = raw if weight == "ratio" else torch.ones_like(raw)
    result = torch.where(valid & ~rejected, kept, torch.zeros_like(raw))
    metrics = _weight_metrics(raw, valid, masked=rejected)
    if level == "token":
        _add_mean(metrics, "offpolicy/rs_stat", torch.where(valid, value, 0.0).sum(), metrics["offpolicy/tokens"])
        metrics["offpolicy/rs_stat/max"] = (torch.where(valid, value, -torch.inf).max() if valid.any()
                                            else value.sum() * 0)
    else:
        rows = valid.any(dim=-1)
        per_seq = value[:, 0] if value.numel() else value.sum(dim=-1)
        _add_mean(metrics, "offpolicy/rs_stat", torch.where(rows, per_seq, 0.0).sum(), metrics["offpolicy/seqs"])
        metrics["offpolicy/rs_stat/max"] = (torch.where(rows, per_seq, -torch.inf).max() if rows.any()
                                            else per_seq.sum() * 0)
    return result, metrics


def seq_mis_weight(
    logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, *, cap: float = 2.0, low: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's sequence IS with a two-sided rejection window (``seq_is_rs``; the MIS preset): w = ρ(y) if
    low <= ρ(y) <= cap, else 0, with low = 1/cap unless given. Unlike ``mis`` at sequence level, sequences the
    learner finds far LESS likely than the sampler did are dropped too, not kept at a tiny weight."""
    low = 1.0 / cap if low is None else low
    _check_bounds(low, cap)
    valid = loss_mask.bool()
    raw = _raw_weight(_token_log_ratio(logprobs_prox, logprobs_behav, valid), valid, "sequence")
    masked = valid & ((raw < low) | (raw > cap))
    weight = torch.where(valid & ~masked, raw, torch.zeros_like(raw))
    return weight, _weight_metrics(raw, valid, masked=masked, low=low, high=cap)


@torch.no_grad()
def normalize_batch_weight(weight: Tensor, loss_mask: Tensor, level: str) -> tuple[Tensor, dict[str, Tensor]]:
    """Self-normalised IS (verl's ``rollout_is_batch_normalize``): the batch's weights divided by their mean, so
    they average 1 over the batch's valid tokens (``token``) or over its sequences (``sequence``, each counted once
    with its ρ(y)). The correction keeps its shape and its rejections; only the overall scale, which otherwise moves
    the effective learning rate with the staleness, is removed. A batch whose weights are all 0 is left as is.
    Call it on the whole step's batch (it is batch-global)."""
    if level not in LEVELS:
        raise ValueError(f"unknown correction level {level!r}; choose one of {LEVELS}")
    valid = loss_mask.bool()
    if level == "token":
        total, count = torch.where(valid, weight, 0.0).sum(), valid.sum()
    else:
        rows = valid.any(dim=-1)
        first = valid.to(torch.int64).argmax(dim=-1)  # each row's first valid token carries its ρ(y)
        per_row = weight.gather(-1, first[:, None]).squeeze(-1)
        total, count = torch.where(rows, per_row, 0.0).sum(), rows.sum()
    mean = total / count.clamp(min=1).to(total.dtype)
    factor = torch.where(mean > 0, 1.0 / mean.clamp(min=1e-30), torch.ones_like(mean))
    return torch.where(valid, weight * factor, torch.zeros_like(weight)), {"offpolicy/batch_norm_factor": factor}


CORRECTION_WEIGHTS: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    name: globals()[spec.function] for name, spec in CORRECTIONS.items() if spec.function is not None}
"""Correction name -> weight function, resolved from ``registry.CORRECTIONS`` (the entries that have one)."""
NO_WEIGHT_CORRECTIONS = tuple(name for name, spec in CORRECTIONS.items() if spec.kind == NO_WEIGHT)
"""Names ``compute_correction`` answers with no weight (``none``)."""


def compute_correction(
    name: str, logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor, **hyperparameters
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The detached weight [B, T] of correction ``name`` (0 off-mask and where rejected; None for ``none``), and its
    metrics. ``hyperparameters`` are the correction's own keywords (those of its function); unset ones take the
    published default.

    ``logprobs_prox`` must be the pass frozen at the start of the step, not one recomputed per mini-batch (§4.6).
    All corrections but the batch-global ones (``registry.CORRECTIONS[name].batch_global``) act row by row, so
    calling them per micro-batch gives the same weights as one call on the whole batch.
    """
    if name in NO_WEIGHT_CORRECTIONS:
        return None, {}
    if name not in CORRECTION_WEIGHTS:
        known = NO_WEIGHT_CORRECTIONS + tuple(CORRECTION_WEIGHTS)
        raise ValueError(f"unknown correction {name!r}; choose one of {known}")
    function = CORRECTION_WEIGHTS[name]
    keywords = tuple(keyword_defaults(function))
    unknown = set(hyperparameters) - set(keywords)
    if unknown:
        raise ValueError(f"correction {name!r} takes {keywords}, not {tuple(sorted(unknown))}")
    with torch.no_grad():
        return function(logprobs_prox, logprobs_behav, loss_mask, **hyperparameters)


# A-3PO ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def approximate_prox_logprobs(
    logprobs: Tensor, logprobs_behav: Tensor, versions: Tensor, loss_mask: Tensor, *, learner_version: int
) -> Tensor:
    """A-3PO (arXiv 2512.06547; AReaL prox_logp_method="loglinear"): ℓprox ≈ ℓμ + α (ℓθ - ℓμ), per token, with
    α = (v_prox - v_behav) / (v_θ - v_behav) clamped to [0, 1]; it saves the no-grad proximal forward pass.

    Version convention (ours): the learner at version v holds the weights that generators tag as version v, trains
    them to produce v + 1, and the batch's tokens carry versions <= v. AReaL's ``compute_prox_logp_approximations``
    takes v_θ = the engine's current version (set to g + 1 together with the rollout's after step g's update, so
    it is the version of the weights being trained: our v) and v_prox = v_θ - 1. So here v_θ = ``learner_version``
    and v_prox = ``learner_version`` - 1: π_prox is the policy one version behind the weights being trained, placed
    on the straight line (in log space, in version) between the token's sampler and the current weights.
    Consequences: α = 0 (ℓprox = ℓμ, weight 1) for tokens sampled by version v - 1 and, since the line degenerates,
    by version v; α = 1/2 for v - 2, 2/3 for v - 3. ``logprobs`` is ℓθ, the current pass (detached here).

    versions [B, T] int (-1 on prompt tokens); returns ℓprox [B, T] in fp32 at least, equal to ℓμ off-mask.
    """
    valid = loss_mask.bool() & (versions >= 0)  # prompt tokens have no generation version
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, logprobs_behav.dtype), torch.float32)
    behav = logprobs_behav.to(dtype)
    v_behav = versions.to(dtype)
    gap_theta = learner_version - v_behav  # v_θ - v_behav
    gap_prox = (learner_version - 1) - v_behav  # v_prox - v_behav
    alpha = torch.where(valid & (gap_theta > 0), gap_prox / gap_theta.clamp(min=1.0), torch.zeros_like(v_behav))
    alpha = alpha.clamp(0.0, 1.0)  # [B, T]
    # where(), not α·(ℓθ - ℓμ): at α = 0 an infinite difference would make 0·inf = NaN.
    moved = behav + alpha * (logprobs.detach().to(dtype) - behav)
    return torch.where(alpha > 0, moved, behav)
