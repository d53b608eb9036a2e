"""Counters reach MLflow only when they say something (stdlib only).

A run's counters (groups dropped as stale, rejected reports, weight-load failures, ...) are 0 almost always. Logged
as a point every step, each one becomes a flat-zero chart, and MLflow's run page, which draws a chart for every
metric, opens on rows of them before the reward. So MetricsLogger passes each report through `CounterFilter`:

- a running total (`CUMULATIVE`) is logged when it differs from the last value logged (a job starts at 0);
- a count over one step or report window (`PER_WINDOW`) is logged when it is not 0, and once more when it falls
  back to 0, so the chart's line does not carry a spike on until the next one.

Everything else, and every value in `progress.jsonl`, is kept as it was. Patterns are fnmatch patterns on the key
without a generator's prefix.
"""
from fnmatch import fnmatchcase

CUMULATIVE = (
    "buffer/dropped_total/*", "buffer/rejected/*", "buffer/rejected_total", "buffer/reclaimed*",
    "buffer/evicted*", "learner/skipped_steps", "weightsync/unchanged_versions", "data/overlong_filtered",
    "data/refused", "data/returned/*", "rollout/resumed_turns",
    "eval/rounds_abandoned", "generator/weight_failures", "generator/rejected_groups", "generator/filtered_groups",
    "generator/skipped_prompts", "generator/reward_errors*", "generator/weight_pushes/*",
    "weightsync/catchup_served", "weightsync/catchup_deltas", "weightsync/catchup_deltas_prepared",
    "weightsync/catchup_prepared_used",
    "rollout/*_errors*", "rollout/*_failures*", "rollout/*timeouts*", "rollout/http_refusals/*",
)
"""Running totals since the job (or the process) started."""
PER_WINDOW = ("buffer/dropped/*", "buffer/dropped_stale", "learner/skipped", "learner/skipped_minibatches")
"""Counts over the step that logs them."""


def counter_kind(key: str) -> str | None:
    """"cumulative", "window", or None for a key that is not a counter."""
    if any(fnmatchcase(key, pattern) for pattern in PER_WINDOW):
        return "window"
    if any(fnmatchcase(key, pattern) for pattern in CUMULATIVE):
        return "cumulative"
    return None


class CounterFilter:
    """Remembers the last value logged for each counter; `keep` returns the report without the counters that
    would repeat what the chart already shows. One per MetricsLogger (one source of reports)."""

    def __init__(self):
        self._last: dict = {}
        self._kinds: dict = {}  # key -> counter_kind(key), cached: a report has the same keys every step

    def keep(self, metrics: dict) -> dict:
        kept = {}
        for key, value in metrics.items():
            kind = self._kinds.get(key, "?")
            if kind == "?":
                kind = self._kinds[key] = counter_kind(key)
            if kind is not None:
                last = self._last.get(key, 0.0)
                if (value == last) if kind == "cumulative" else (value == 0 and last == 0):
                    continue
                self._last[key] = value
            kept[key] = value
        return kept
