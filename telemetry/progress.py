"""The live progress line: step, reward, staleness, tokens/s and ETA.

The reward shown first is that of every group the policy sampled since the last step (`reward/sampled_mean`,
buffer/sampled.py), the number to compare with another framework's; the trained groups' (`reward/mean`) follows,
named: with algo.dynamic_sampling it leaves out the groups whose samples all scored alike, so it reads higher.

On a terminal it redraws one line; otherwise it prints a line every `every_s` seconds, so logs stay readable.
Each update is also appended to `progress.jsonl`, which `asyncrl run` reads to draw the same line.
"""
import json
import sys
import time


def format_line(step: int, total: int, metrics: dict, elapsed_s: float) -> str:
    eta = elapsed_s / max(step, 1) * (total - step)
    return (
        f"step {step}/{total} | {format_reward(metrics)}"
        f" | staleness {metrics.get('buffer/staleness/mean', 0.0):.2f} (max {metrics.get('buffer/staleness/max', 0):.0f})"
        f" | learner {metrics.get('perf/learner/tokens_per_s', 0.0):.0f} tok/s"
        f" | gen {metrics.get('perf/generator/tokens_per_s', 0.0):.0f} tok/s"
        f" | ETA {_fmt_s(eta)}"
    )


def format_reward(metrics: dict) -> str:
    """'reward 0.410 sampled, 0.520 trained'; a row without the sampled reward (written before it existed, or a
    trainer that reports one reward) shows the one it has, named."""
    trained = metrics.get("reward/mean", float("nan"))
    if "reward/sampled_mean" not in metrics:
        return f"reward {trained:.3f} trained"
    return f"reward {metrics['reward/sampled_mean']:.3f} sampled, {trained:.3f} trained"


def _fmt_s(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class ProgressDisplay:
    def __init__(self, total_steps: int, jsonl_path: str | None, stream=None, enabled: bool = True, every_s: float = 10):
        self.total = total_steps
        self.jsonl_path = jsonl_path
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self.started = time.monotonic()
        self._last_print = 0.0
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, step: int, metrics: dict) -> None:
        elapsed = time.monotonic() - self.started
        if self.jsonl_path:
            with open(self.jsonl_path, "a") as handle:
                handle.write(json.dumps({"step": step, "total": self.total, "elapsed_s": elapsed, **metrics}) + "\n")
        if not self.enabled:
            return
        line = format_line(step, self.total, metrics, elapsed)
        if self._tty:
            self.stream.write("\r\033[K" + line)
            self.stream.flush()
        elif time.monotonic() - self._last_print >= self.every_s or step == self.total:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_print = time.monotonic()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
