"""The fleet's view of the generators' own reports, for the learner's metrics: one pure function shared by both
backends. Reports were checked by plausibility.check_stats (finite numbers), but their values are still whatever a
generator claims, so a fraction is clamped into [0, 1] before it is averaged, and a family of metrics named by a
generator is bounded: error counts only under the reasons the generator has (ERROR_REASONS), tool timings under at
most MAX_FAMILY_KEYS plausible names, so a hostile report cannot flood the learner's metrics. (Each generator also
logs its own report to MLflow under its id, untouched.)"""
import re

EPISODE_MEANS = ("rollout/turns/mean", "rollout/tool_calls/mean", "rollout/env_tokens/mean", "timing/reward_s")
"""Averaged over the generators that report them (multi-turn episodes: docs/agents.md)."""
TOTALS = ("generator/tokens", "generator/busy_s", "rollout/resumed_turns", "generator/skipped_prompts",
          "generator/reward_errors")
"""Summed over the generators: counts since each started. generator/tokens (every token sampled) over
generator/busy_s (seconds spent sampling or loading weights) is the fleet's rate while working, whatever each
report's own window saw: a generator waiting for weights whenever the learner logs reports a tokens/s of 0 at every
step."""
ERROR_REASONS = {
    "rollout/tool_errors/": ("timeout", "error", "output_too_long", "malformed", "unknown_tool", "bad_arguments"),
    "rollout/env_errors/": ("timeout", "error", "bad_result", "bad_messages", "cannot_append", "no_requests",
                            "bad_reward", "agent_error", "agent_refused", "agent_timeout"),
    "rollout/http_refusals/": ("unknown_key", "bad_body", "concurrent_request", "bad_parameter", "bad_messages",
                               "turn_limit", "prompt_too_long", "cannot_render", "tools_changed", "after_cut",
                               "history_edited", "reply_omitted", "nothing_new", "token_budget"),
    "generator/reward_errors/": ("timeout", "error", "bad_value"),
}
"""The reasons the generator counts (generator/agents/, openai_session.REFUSAL_CAUSES, generator/rewards/scorer.py;
tests/unit/test_timing.py checks they agree): only these are summed, whatever else a report names."""
MEAN_FAMILIES = ("timing/tool/",)
MAX_FAMILY_KEYS = 16
FAMILY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def fleet_metrics(reports: list) -> dict:
    """From `reports` (each live generator's latest):
    - perf/generator/tokens_per_s, summed;
    - timing/generator/idle_frac, averaged over those that report it (absent when none does);
    - generator/filtered_groups: the zero-variance groups they dropped before sending (algo.dynamic_sampling),
      summed, since each started;
    - TOTALS summed;
    - episodes: EPISODE_MEANS and `rollout/tool_use_frac` (clamped) averaged, the error
      families summed, `timing/tool/<name>_s` averaged (each only when some generator reports it)."""
    out = {"perf/generator/tokens_per_s": _total(reports, "perf/generator/tokens_per_s")}
    idle = [min(max(float(report["timing/generator/idle_frac"]), 0.0), 1.0) for report in reports
            if "timing/generator/idle_frac" in report]
    if idle:
        out["timing/generator/idle_frac"] = sum(idle) / len(idle)
    if any("generator/filtered_groups" in report for report in reports):
        out["generator/filtered_groups"] = _total(reports, "generator/filtered_groups")
    for key in EPISODE_MEANS + ("rollout/tool_use_frac",):
        values = [float(report[key]) for report in reports if key in report]
        if key.endswith("_frac"):
            values = [min(max(value, 0.0), 1.0) for value in values]
        if values:
            out[key] = sum(values) / len(values)
    totals = TOTALS + tuple(prefix + reason for prefix, reasons in ERROR_REASONS.items() for reason in reasons)
    for key in totals:
        if any(key in report for report in reports):
            out[key] = _total(reports, key)
    for prefix in MEAN_FAMILIES:
        for key in _family(reports, prefix):
            values = [float(report[key]) for report in reports if key in report]
            out[key] = sum(values) / len(values)
    return out


def _family(reports: list, prefix: str) -> list:
    """The keys under `prefix` whose names are plausible, at most MAX_FAMILY_KEYS of them (sorted)."""
    names = {key for report in reports for key in report
             if key.startswith(prefix) and FAMILY_NAME.fullmatch(key[len(prefix):])}
    return sorted(names)[:MAX_FAMILY_KEYS]


def _total(reports: list, key: str) -> float:
    return float(sum(report.get(key, 0.0) for report in reports))
