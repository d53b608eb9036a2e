"""The fleet's view of the generators' own reports, for the learner's metrics: one pure function shared by both
backends. Reports were checked by plausibility.check_stats (finite numbers), but their values are still whatever a
generator claims, so a fraction is clamped into [0, 1] before it is averaged."""


def fleet_metrics(reports: list) -> dict:
    """From `reports` (each live generator's latest):
    - perf/generator/tokens_per_s, summed;
    - timing/generator/idle_frac, averaged over those that report it (absent when none does);
    - reward/sampled_mean: the mean of their `reward/mean`, the reward of everything they sampled in their last
      report window. The learner's own reward/mean is over the groups it trained on, which dynamic sampling
      biases (it drops the all-0 and the all-1 groups); this one is the policy's, as a peer without the filter
      would report it (absent when no report has a reward yet);
    - generator/filtered_groups: the zero-variance groups they dropped before sending (algo.dynamic_sampling),
      summed, since each started."""
    out = {"perf/generator/tokens_per_s": _total(reports, "perf/generator/tokens_per_s")}
    idle = [min(max(float(report["timing/generator/idle_frac"]), 0.0), 1.0) for report in reports
            if "timing/generator/idle_frac" in report]
    if idle:
        out["timing/generator/idle_frac"] = sum(idle) / len(idle)
    rewards = [float(report["reward/mean"]) for report in reports if "reward/mean" in report]
    if rewards:
        out["reward/sampled_mean"] = sum(rewards) / len(rewards)
    if any("generator/filtered_groups" in report for report in reports):
        out["generator/filtered_groups"] = _total(reports, "generator/filtered_groups")
    return out


def _total(reports: list, key: str) -> float:
    return float(sum(report.get(key, 0.0) for report in reports))
