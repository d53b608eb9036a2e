"""Off-policyness and entropy metrics (docs/algorithms.md §3, pitfall §4.3), and the rule for combining
per-micro-batch metrics.

``compute_offpolicy_metrics`` measures how far the generator's distribution μ is from the learner's step-start
policy π_prox on the tokens actually trained. It is the early-warning signal: K3 spikes and ESS drops precede
collapses (Liu/Li "When Speed Kills Stability"). Everything is detached and computed in fp64, because K3 of a
healthy run is 1e-5 or smaller and fp32 cancellation in ρ - log ρ - 1 would drown it.
``compute_staleness_metrics`` says how many learner versions old the trained tokens were.
"""
import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from asyncrl.algos.log_ratio import LOG_RATIO_CLAMP, masked_log_ratio


EMPTY_OFFPOLICY_METRICS = {
    "offpolicy/mismatch_k1": 0.0,
    "offpolicy/mismatch_k3": 0.0,
    "offpolicy/abs_diff": 0.0,
    "offpolicy/abs_diff/max": 0.0,
    "offpolicy/tis_abs": 0.0,
    "offpolicy/ppl_prox": 1.0,
    "offpolicy/ppl_behav": 1.0,
    "offpolicy/log_ppl_diff": 0.0,
    "offpolicy/ppl_ratio": 1.0,
    "offpolicy/chi2_token": 0.0,
    "offpolicy/chi2_seq": 0.0,
    "offpolicy/ess": 1.0,
}
"""What ``compute_offpolicy_metrics`` reports with no valid token: the values of identical policies. Nothing was
observed, and a NaN would poison the run's plots."""


@torch.no_grad()
def compute_offpolicy_metrics(logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """Mismatch between π_prox and the behaviour policy μ over valid tokens ([B, T] inputs), as Python floats.

    With ρ_t = π_prox / μ = exp(ℓprox - ℓμ) (|log ρ_t| clamped to 20), tokens t valid, sequences y with a valid token:
      offpolicy/mismatch_k1     mean_t(ℓμ - ℓprox)             k1 estimate of KL(μ || π_prox) (verl's "kl")
      offpolicy/mismatch_k3     mean_t(ρ - log ρ - 1)          k3 estimate, >= 0 per token, low variance
      offpolicy/abs_diff        mean_t |ℓprox - ℓμ|            (slime's train_rollout_logprob_abs_diff)
      offpolicy/abs_diff/max    max_t  |ℓprox - ℓμ|
      offpolicy/tis_abs         mean_t |ρ - 1|
      offpolicy/ppl_prox        mean_y exp(-mean_t ℓprox)      perplexity of the sampled text under π_prox
      offpolicy/ppl_behav       mean_y exp(-mean_t ℓμ)
      offpolicy/log_ppl_diff    mean_y (mean_t ℓμ - mean_t ℓprox)   = mean_y -log ρ_geo(y)
      offpolicy/ppl_ratio       mean_y exp(mean_t ℓμ - mean_t ℓprox) = mean_y 1/ρ_geo(y)
      offpolicy/chi2_token      mean_t ρ² - 1
      offpolicy/chi2_seq        mean_y exp(2 Σ_t log ρ_t) - 1  (the sum clamped to ±20 first, as verl)
      offpolicy/ess             (Σ ρ)² / (N Σ ρ²)               Kish effective sample size / N, in (0, 1]
    The values are over the tensors given: call it on a rank's whole batch, not per micro-batch. A 1-D input is
    read as ONE sequence (the sequence-level numbers then describe that concatenation).
    """
    if logprobs_prox.dim() == 1:
        logprobs_prox, logprobs_behav, loss_mask = logprobs_prox[None], logprobs_behav[None], loss_mask[None]
    valid = loss_mask.bool()  # [B, T]
    if not bool(valid.any()):
        return dict(EMPTY_OFFPOLICY_METRICS)
    # The perplexities read ℓ itself, in fp64 with the padding (-inf) selected away before any arithmetic.
    prox = torch.where(valid, logprobs_prox.double(), 0.0)
    behav = torch.where(valid, logprobs_behav.double(), 0.0)
    log_rho = masked_log_ratio(logprobs_prox, logprobs_behav, valid, torch.float64)  # [B, T]
    token_log_rho = log_rho[valid]  # [N]
    rho = torch.exp(token_log_rho)
    rho_sq_mean = (rho * rho).mean()
    rows = valid.any(dim=-1)  # [B]
    lengths = valid.sum(dim=-1)[rows].double()  # [S]
    seq_log_rho = log_rho.sum(dim=-1)[rows]  # [S]
    log_ppl_diff = -seq_log_rho / lengths  # [S], mean ℓμ - mean ℓprox
    return {
        "offpolicy/mismatch_k1": float(-token_log_rho.mean()),
        # expm1(x) - x == ρ - 1 - log ρ without the cancellation of subtracting numbers close to 1.
        "offpolicy/mismatch_k3": float((torch.expm1(token_log_rho) - token_log_rho).mean()),
        "offpolicy/abs_diff": float(token_log_rho.abs().mean()),
        "offpolicy/abs_diff/max": float(token_log_rho.abs().max()),
        "offpolicy/tis_abs": float(torch.expm1(token_log_rho).abs().mean()),
        "offpolicy/ppl_prox": float(torch.exp(-prox.sum(dim=-1)[rows] / lengths).mean()),
        "offpolicy/ppl_behav": float(torch.exp(-behav.sum(dim=-1)[rows] / lengths).mean()),
        "offpolicy/log_ppl_diff": float(log_ppl_diff.mean()),
        "offpolicy/ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "offpolicy/chi2_token": float(rho_sq_mean - 1.0),
        "offpolicy/chi2_seq": float(torch.exp(2.0 * seq_log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).mean() - 1.0),
        "offpolicy/ess": float(rho.mean() ** 2 / rho_sq_mean),
    }


@torch.no_grad()
def compute_mult_prob_error(logprobs_learner: Tensor, logprobs_behav: Tensor, valid: Tensor) -> float:
    """NeMo-RL's framework-mismatch alert: mean over the `valid` tokens of exp(|ℓlearner - ℓμ|), 1.0 for none.

    ℓlearner must be the learner's pass with the weights that sampled the tokens (the step-start policy, on tokens
    of the learner's own version): then staleness plays no part, and a value above ~1.05 (5 % average probability
    error per token) is a bug in the pipeline (a wrong sampling temperature, a nucleus the learner did not apply,
    misaligned tokens, weights that did not arrive), not something a correction should absorb. fp64, |Δ| clamped
    to 20 like the other ratios.
    """
    if not bool(valid.any()):
        return 1.0
    delta = (logprobs_learner.double() - logprobs_behav.double())[valid.bool()]
    return float(torch.exp(delta.abs().clamp(max=LOG_RATIO_CLAMP)).mean())


@torch.no_grad()
def compute_group_abs_diff(logprobs_learner: Tensor, logprobs_behav: Tensor, loss_mask: Tensor,
                           group_rows: list[int]) -> list[tuple[float, int]]:
    """Per group, its `group_rows[g]` consecutive rows of the [B, T] inputs (groups of per-turn samples differ in
    size): (Σ_t |ℓlearner - ℓμ|, valid tokens), the numerator and denominator of the group's offpolicy/abs_diff, so
    a caller can average over any run of groups weighting each token once (learner/trust.py). fp64, |Δ| clamped
    to 20 like the ratios."""
    valid = loss_mask.bool()
    delta = torch.where(valid, (logprobs_learner.double() - logprobs_behav.double()).abs(), 0.0)
    row_sums = delta.clamp(max=LOG_RATIO_CLAMP).sum(dim=-1)  # [B]
    row_tokens = valid.sum(dim=-1)  # [B]
    return [(float(total.sum()), int(tokens.sum()))
            for total, tokens in zip(row_sums.split(group_rows), row_tokens.split(group_rows))]


@torch.no_grad()
def compute_staleness_metrics(
    versions: Tensor, loss_mask: Tensor, learner_version: int, max_staleness: int
) -> dict[str, float]:
    """How many versions behind the learner the trained tokens were sampled (AReaL's version staleness stats).

    Convention: the learner at version ``learner_version`` = v trains on tokens tagged with versions <= v, so a
    token's staleness v - version is >= 0 (0: sampled by the weights being trained). versions [B, T] int, -1 on
    prompt tokens, which the mask excludes. Keys (fractions over valid tokens unless said):
      offpolicy/staleness/mean, /max, /min
      offpolicy/staleness/hist/<k>          fraction of tokens with staleness k, k = 0..max_staleness
      offpolicy/staleness/frac_above_max    fraction with staleness > max_staleness (the buffer should make it 0)
      offpolicy/staleness/multi_version_seq_frac  fraction of sequences (with a valid token) whose tokens span more
                                            than one version (interrupted / partial rollouts)
    A valid token with a negative version or a version above the learner's breaks the convention and raises.
    """
    valid = loss_mask.bool()  # [B, T]
    token_versions = versions[valid].long()  # [N]
    if bool((token_versions < 0).any()) or bool((token_versions > learner_version).any()):
        raise ValueError(f"valid tokens must carry versions in [0, {learner_version}] (learner v{learner_version}), "
                         f"got {sorted(set(token_versions.tolist()))}")
    metrics = {f"offpolicy/staleness/hist/{k}": 0.0 for k in range(max_staleness + 1)}
    if token_versions.numel() == 0:
        return {"offpolicy/staleness/mean": 0.0, "offpolicy/staleness/max": 0.0, "offpolicy/staleness/min": 0.0,
                **metrics, "offpolicy/staleness/frac_above_max": 0.0,
                "offpolicy/staleness/multi_version_seq_frac": 0.0}
    staleness = learner_version - token_versions  # [N], >= 0
    tokens = staleness.numel()
    counts = torch.bincount(staleness.clamp(max=max_staleness + 1), minlength=max_staleness + 2).tolist()
    metrics.update({f"offpolicy/staleness/hist/{k}": counts[k] / tokens for k in range(max_staleness + 1)})
    big = torch.iinfo(torch.long).max
    masked_versions = versions.long().masked_fill(~valid, big)
    newest = versions.long().masked_fill(~valid, -1).max(dim=-1).values  # [B]
    oldest = masked_versions.min(dim=-1).values
    rows = valid.any(dim=-1)
    return {
        "offpolicy/staleness/mean": float(staleness.double().mean()),
        "offpolicy/staleness/max": float(staleness.max()),
        "offpolicy/staleness/min": float(staleness.min()),
        **metrics,
        "offpolicy/staleness/frac_above_max": counts[max_staleness + 1] / tokens,
        "offpolicy/staleness/multi_version_seq_frac": float((rows & (newest > oldest)).sum()) / float(rows.sum()),
    }


def compute_entropy_from_logits(logits: Tensor) -> Tensor:
    """Token entropy H = logsumexp(z) - Σ softmax(z)·z, shape [...] from logits [..., V].

    Pass the logits the sampler used (already divided by the temperature), or the entropy describes a
    distribution nobody sampled. Computed in fp32 at least; -inf logits (banned tokens) contribute 0. It holds
    a [..., V] softmax, so the caller chunks over tokens for large vocabularies.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [..., V]
    probs = torch.softmax(z, dim=-1)  # [..., V]
    # 0 · -inf is NaN, in the forward and in the backward, so banned logits are zeroed before the product.
    z_finite = z.masked_fill(torch.isneginf(z), 0.0)
    return torch.logsumexp(z, dim=-1) - (probs * z_finite).sum(dim=-1)


COUNT_LEAVES = ("tokens", "seqs")
"""Metric leaves that are counts: ``<dir>/tokens`` (valid tokens) and ``<dir>/seqs`` (sequences with one)."""


def _denominator_key(name: str, counts: Mapping[str, float]) -> str | None:
    """The count a mean ``name`` divides by: ``<dir>/seqs`` if its leaf starts with ``seq_``, else ``<dir>/tokens``,
    for the deepest ``<dir>`` above ``name`` that has that count (``tokens`` if no ``seqs`` count exists)."""
    parts = name.split("/")
    wanted = ("seqs", "tokens") if parts[-1].startswith("seq_") else ("tokens",)
    for leaf in wanted:
        for depth in range(len(parts) - 1, 0, -1):
            key = "/".join(parts[:depth]) + f"/{leaf}"
            if key in counts:
                return key
    return None


def combine_token_metrics(metrics_list: Iterable[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Combine the metric dicts of several micro-batches (or ranks) into the step's values.

    Convention (losses.py module doc): count keys ``<dir>/tokens`` and ``<dir>/seqs`` and ``<name>_sum`` keys add,
    ``/max`` keys take the max and ``/min`` keys the min, and each mean ``<name>`` is recomputed as
    ``<name>_sum / max(count, 1)``, where count is ``<dir>/seqs`` for a leaf starting with ``seq_`` and
    ``<dir>/tokens`` otherwise, from the deepest ``<dir>`` above the key that has one (``offpolicy/kept/m2`` divides
    by ``offpolicy/kept/tokens``, ``offpolicy/seq_masked_frac`` by ``offpolicy/seqs``). A mean is never averaged
    across micro-batches, because micro-batches hold different token counts. A ``/min`` whose count is 0 reports 0.
    Derived: for every combined ``<p>/sq_mean`` next to ``<p>/mean``, ``<p>/std`` = sqrt(sq_mean - mean²) and
    ``<p>/ess`` = mean² / sq_mean (Kish effective sample size / N of those weights; 1 when sq_mean = 0); a call's
    own ``<p>/std`` and ``<p>/ess`` are skipped, since they cannot be combined.
    Any other key has no defined combination and raises, so a new metric has to pick a rule.
    """
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    mins: dict[str, float] = {}
    for metrics in metrics_list:
        for key, value in metrics.items():
            value = float(value)
            if key.endswith("_sum") or key.rsplit("/", 1)[-1] in COUNT_LEAVES:
                sums[key] = sums.get(key, 0.0) + value
            elif key.endswith("/max"):
                maxes[key] = max(maxes.get(key, value), value)
            elif key.endswith("/min"):
                mins[key] = min(mins.get(key, value), value)
            elif key.endswith(("/std", "/ess")) and f"{key.rsplit('/', 1)[0]}/sq_mean_sum" in metrics:
                continue  # derived: recomputed below from the combined mean and sq_mean
            elif f"{key}_sum" not in metrics:
                raise ValueError(f"metric {key!r} is neither a _sum, count, /max nor /min key and has no {key}_sum")
    counts = {key: value for key, value in sums.items() if key.rsplit("/", 1)[-1] in COUNT_LEAVES}
    combined = {**counts, **maxes}
    for key, value in mins.items():
        count_key = _denominator_key(key[: -len("/min")], counts)
        combined[key] = value if count_key is None or counts[count_key] > 0 else 0.0
    for key, total in sums.items():
        if key.endswith("_sum"):
            name = key[: -len("_sum")]
            count_key = _denominator_key(name, counts)
            combined[name] = total / max(counts[count_key] if count_key else 0.0, 1.0)
    for key in [k for k in combined if k.endswith("/sq_mean")]:
        prefix = key[: -len("/sq_mean")]
        if f"{prefix}/mean" in combined:
            mean, sq_mean = combined[f"{prefix}/mean"], combined[key]
            combined[f"{prefix}/std"] = math.sqrt(max(sq_mean - mean * mean, 0.0))
            combined[f"{prefix}/ess"] = mean * mean / sq_mean if sq_mean > 0 else 1.0
    return combined
