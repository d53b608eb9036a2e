"""The fleet's view of the generators' own reports, for the learner's metrics: one pure function shared by both
backends. Reports were checked by plausibility.check_stats (finite numbers), but their values are still whatever a
generator claims, so a fraction is clamped into [0, 1] before it is averaged."""


def fleet_metrics(reports: list) -> dict:
    """perf/generator/tokens_per_s summed over `reports` (each live generator's latest), and
    timing/generator/idle_frac averaged over those that report it (absent when none does)."""
    out = {"perf/generator/tokens_per_s": float(sum(report.get("perf/generator/tokens_per_s", 0.0)
                                                    for report in reports))}
    idle = [min(max(float(report["timing/generator/idle_frac"]), 0.0), 1.0) for report in reports
            if "timing/generator/idle_frac" in report]
    if idle:
        out["timing/generator/idle_frac"] = sum(idle) / len(idle)
    return out
