"""Off-policyness and entropy metrics (reference/offpolicy_algorithms.md §3, pitfall §4.3), and the rule for
combining per-micro-batch metrics.

``compute_offpolicy_metrics`` measures how far the generator's distribution μ is from the learner's step-start
policy π_prox on the tokens actually trained. It is the early-warning signal: K3 spikes and ESS drops precede
collapses (Liu/Li "When Speed Kills Stability"). Everything is detached and computed in fp64, because K3 of a
healthy run is 1e-5 or smaller and fp32 cancellation in ρ - log ρ - 1 would drown it.
"""
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""|log ρ| is clamped to this before exp, as in the losses, so ρ² stays finite."""


@torch.no_grad()
def compute_offpolicy_metrics(logprobs_prox: Tensor, logprobs_behav: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """Mismatch between π_prox and the behaviour policy μ over valid tokens ([B, T] inputs), as Python floats.

    With ρ = π_prox / μ = exp(ℓprox - ℓμ):
      offpolicy/mismatch_k1  mean(ℓμ - ℓprox)            k1 estimate of KL(μ || π_prox) (verl's "kl")
      offpolicy/mismatch_k3  mean(ρ - log ρ - 1)         k3 estimate, >= 0 per token, low variance
      offpolicy/abs_diff     mean |ℓprox - ℓμ|
      offpolicy/ess          (Σ ρ)² / (N Σ ρ²)            Kish effective sample size / N, in (0, 1]
      offpolicy/chi2_token   mean(ρ²) - 1
    With no valid token the result is that of identical policies (0, 0, 0, 1, 0): nothing was observed, and a
    NaN would poison the run's plots. The values are over the tensors given; call it on a rank's whole batch.
    """
    valid = loss_mask.bool()  # [B, T]
    tokens = int(valid.sum())
    if tokens == 0:
        return {
            "offpolicy/mismatch_k1": 0.0,
            "offpolicy/mismatch_k3": 0.0,
            "offpolicy/abs_diff": 0.0,
            "offpolicy/ess": 1.0,
            "offpolicy/chi2_token": 0.0,
        }
    # Select before subtracting: -inf - -inf at padding is NaN.
    log_rho = logprobs_prox.double()[valid] - logprobs_behav.double()[valid]  # [N]
    log_rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_rho)  # [N]
    rho_sq_mean = (rho * rho).mean()
    return {
        "offpolicy/mismatch_k1": float(-log_rho.mean()),
        # expm1(x) - x == ρ - 1 - log ρ without the cancellation of subtracting numbers close to 1.
        "offpolicy/mismatch_k3": float((torch.expm1(log_rho) - log_rho).mean()),
        "offpolicy/abs_diff": float(log_rho.abs().mean()),
        "offpolicy/ess": float(rho.mean() ** 2 / rho_sq_mean),
        "offpolicy/chi2_token": float(rho_sq_mean - 1.0),
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


def combine_token_metrics(metrics_list: Iterable[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Combine the metric dicts of several micro-batches (or ranks) into the step's values.

    Convention (losses.py module doc): ``<area>/tokens`` and ``<name>_sum`` keys add, ``/max`` keys take the
    max, and each mean ``<name>`` is recomputed as ``<name>_sum / max(<area>/tokens, 1)``. A mean is never
    averaged across micro-batches, because micro-batches hold different token counts. Any other key has no
    defined combination and raises, so a new metric has to pick a rule.
    """
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    for metrics in metrics_list:
        for key, value in metrics.items():
            value = float(value)
            if key.endswith("_sum") or key.endswith("/tokens"):
                sums[key] = sums.get(key, 0.0) + value
            elif key.endswith("/max"):
                maxes[key] = max(maxes.get(key, value), value)
            elif f"{key}_sum" not in metrics:
                raise ValueError(f"metric {key!r} is neither a _sum, /tokens nor /max key and has no {key}_sum")
    combined = {key: value for key, value in sums.items() if key.endswith("/tokens")}
    combined.update(maxes)
    for key, total in sums.items():
        if key.endswith("_sum"):
            name = key[: -len("_sum")]
            area = name.split("/", 1)[0]
            combined[name] = total / max(sums.get(f"{area}/tokens", 0.0), 1.0)
    return combined
