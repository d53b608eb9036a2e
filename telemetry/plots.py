"""The run's dashboards as PNG artifacts (`plots/` in the job's MLflow run), refreshed during the run and at its end.

MLflow draws one chart per metric; some questions need several on one page, or a shape MLflow cannot draw:

- `reward.png`: the training reward, and the held-out evaluation's when there is one;
- `staleness.png`: mean and max staleness per step, and the histogram over time (the share of each step's trained tokens
  sampled 0, 1, ... versions behind);
- `offpolicy.png`: the off-policy dashboard: mismatch k3, the IS weights' effective sample size and max, and the
  share of tokens masked;
- `throughput.png`: tokens/s of the learner and of each generator, and each side's idle fraction, which says
  whether generation and training overlap (what to check first when async is not faster).

Every series is read back from the run itself, so the generators' (logged under their prefixes from other
processes) and a resumed learner's earlier lives are included. matplotlib draws through its object-oriented API
(no pyplot state), off the training thread.
"""
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

LEARNER_KEYS = ("reward/sampled_mean", "reward/mean", "eval/all/mean_reward", "buffer/staleness/mean",
                "buffer/staleness/max", "offpolicy/mismatch_k3", "offpolicy/is_weight/ess", "offpolicy/is_weight/max",
                "offpolicy/masked_frac", "perf/learner/tokens_per_s", "timing/learner/idle_frac")
GENERATOR_KEYS = ("perf/generator/tokens_per_s", "timing/generator/idle_frac")
"""Logged by each generator under its own prefix (`gen-0/perf/generator/tokens_per_s`)."""
PLOT_FILES = ("reward.png", "staleness.png", "offpolicy.png", "throughput.png")


MAX_GENERATORS = 32
"""Generators drawn, first by name: the run is writable by any process that reaches MLflow, and a flood of
generator ids must not make every redraw read and draw thousands of series."""


def generator_keys(metric_keys) -> dict:
    """{generator id: {short key: full key}} for the first MAX_GENERATORS generators (by id) that logged a
    GENERATOR_KEYS metric."""
    found: dict = {}
    for key in metric_keys:
        for short in GENERATOR_KEYS:
            if key.endswith("/" + short) and key.count("/") == short.count("/") + 1:
                found.setdefault(key[: -len(short) - 1], {})[short] = key
    return {name: found[name] for name in sorted(found)[:MAX_GENERATORS]}


def read_series(client, run_id: str, keys) -> dict:
    """{key: (steps, values)} sorted by step, for the keys the run has (the last point of a step wins)."""
    series = {}
    for key in keys:
        points = {}
        for metric in client.get_metric_history(run_id, key):
            points[metric.step] = metric.value
        if points:
            steps = sorted(points)
            series[key] = (steps, [points[step] for step in steps])
    return series


HISTOGRAM_PREFIX = "offpolicy/staleness/hist/"
"""The share of each step's trained tokens sampled k versions behind (algos/metrics.py), k = 0..max_staleness."""


def histogram_keys(metric_keys) -> list:
    """The run's offpolicy/staleness/hist/<k> keys, by k."""
    found = [key for key in metric_keys if key.startswith(HISTOGRAM_PREFIX) and key[len(HISTOGRAM_PREFIX):].isdigit()]
    return sorted(found, key=lambda key: int(key[len(HISTOGRAM_PREFIX):]))


def staleness_histogram(series: dict, keys: list) -> tuple:
    """(steps, shares): shares[i][k] is the share of step steps[i]'s tokens sampled k versions behind (0 where
    that bin was not logged at the step)."""
    steps = sorted({step for key in keys if key in series for step in series[key][0]})
    columns = {key: dict(zip(*series[key])) for key in keys if key in series}
    return steps, [[columns.get(key, {}).get(step, 0.0) for key in keys] for step in steps]


def _figure(rows: int, cols: int, title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * cols, 3.2 * rows))
    # fixed margins: a layout engine measuring every label takes half the drawing time
    fig.subplots_adjust(left=0.09 / cols ** 0.5, right=0.97, bottom=0.16 / rows, top=1 - 0.2 / rows, wspace=0.3,
                        hspace=0.55)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    fig.suptitle(title)
    return fig, axes


def _line(ax, series: dict, key: str, label: str | None = None, **style) -> bool:
    if key not in series:
        return False
    steps, values = series[key]
    ax.plot(steps, values, label=label or key, **style)
    return True


def _finish(ax, title: str, drew: bool, ylabel: str | None = None) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    if not drew:
        ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def draw_reward(series: dict, path: str) -> None:
    fig, (ax,) = _figure(1, 1, "reward")
    drew = _line(ax, series, "reward/sampled_mean", "sampled (reward/sampled_mean)")
    drew |= _line(ax, series, "reward/mean", "trained groups (reward/mean)", alpha=0.6)
    drew |= _line(ax, series, "eval/all/mean_reward", "held-out eval", marker="o")
    _finish(ax, "mean reward", drew)
    fig.savefig(path, dpi=90)


def draw_staleness(series: dict, histogram: tuple, path: str) -> None:
    fig, axes = _figure(1, 2, "staleness (versions between sampling and training)")
    drew = _line(axes[0], series, "buffer/staleness/mean", "mean")
    drew |= _line(axes[0], series, "buffer/staleness/max", "max", alpha=0.6)
    _finish(axes[0], "per step", drew)
    steps, shares = histogram
    if steps:
        matrix = [list(column) for column in zip(*shares)]  # rows: staleness value, columns: steps
        image = axes[1].imshow(matrix, aspect="auto", origin="lower", interpolation="nearest", vmin=0, vmax=1,
                               extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(matrix) - 0.5), cmap="viridis")
        fig.colorbar(image, ax=axes[1], label="share of the step's tokens")
        axes[1].set_ylabel("staleness")
    _finish(axes[1], "histogram over time", bool(steps))
    axes[1].grid(False)
    fig.savefig(path, dpi=90)


def draw_offpolicy(series: dict, path: str) -> None:
    fig, axes = _figure(2, 2, "off-policy dashboard (sampler vs learner)")
    panels = (("offpolicy/mismatch_k3", "mismatch k3 (KL estimate)"),
              ("offpolicy/is_weight/ess", "IS weights: effective sample size / n"),
              ("offpolicy/is_weight/max", "IS weight max"), ("offpolicy/masked_frac", "tokens masked (share)"))
    for ax, (key, title) in zip(axes, panels):
        _finish(ax, title, _line(ax, series, key, key))
    fig.savefig(path, dpi=90)


def draw_throughput(series: dict, generators: dict, path: str) -> None:
    fig, axes = _figure(1, 2, "throughput and overlap")
    drew = _line(axes[0], series, "perf/learner/tokens_per_s", "learner")
    for name, keys in sorted(generators.items()):
        drew |= _line(axes[0], series, keys.get("perf/generator/tokens_per_s", ""), name, alpha=0.8)
    _finish(axes[0], "tokens/s", drew)
    drew = _line(axes[1], series, "timing/learner/idle_frac", "learner")
    for name, keys in sorted(generators.items()):
        drew |= _line(axes[1], series, keys.get("timing/generator/idle_frac", ""), name, alpha=0.8)
    axes[1].set_ylim(-0.02, 1.02)
    _finish(axes[1], "idle fraction (waiting on the other side)", drew)
    fig.savefig(path, dpi=90)


def draw_all(client, run_id: str, out_dir: str) -> list:
    """Reads the run back and writes PLOT_FILES into out_dir; returns their paths."""
    metric_keys = client.get_run(run_id).data.metrics
    generators = generator_keys(metric_keys)
    bins = histogram_keys(metric_keys)
    keys = [*LEARNER_KEYS, *bins, *(key for found in generators.values() for key in found.values())]
    series = read_series(client, run_id, keys)
    histogram = staleness_histogram(series, bins)
    paths = [os.path.join(out_dir, name) for name in PLOT_FILES]
    draw_reward(series, paths[0])
    draw_staleness(series, histogram, paths[1])
    draw_offpolicy(series, paths[2])
    draw_throughput(series, generators, paths[3])
    return paths


class PlotPublisher:
    """Redraws the plots every `every_s` seconds on a background thread (a refresh still running is not stacked),
    and once more at the end. A failure is logged and never stops training."""

    def __init__(self, tracking_uri: str, run_id: str, job_dir: str, every_s: float, clock=time.monotonic):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self.out_dir = os.path.join(job_dir, "plots")
        self.every_s = every_s
        self.clock = clock
        self._due = clock() + every_s
        self.refreshes = 0
        self._lock = threading.Lock()  # one drawing at a time: the final one waits for a periodic one
        self._thread: threading.Thread | None = None

    def after_step(self) -> None:
        if self.every_s <= 0 or self.clock() < self._due or (self._thread and self._thread.is_alive()):
            return
        self._due = self.clock() + self.every_s
        self._thread = threading.Thread(target=self.refresh, name="asyncrl-plots", daemon=True)
        self._thread.start()

    def refresh(self) -> bool:
        with self._lock:
            try:
                os.makedirs(self.out_dir, exist_ok=True)
                draw_all(self.client, self.run_id, self.out_dir)
                self.client.log_artifacts(self.run_id, self.out_dir, "plots")
                self.refreshes += 1
                return True
            except Exception as err:
                log.warning("mlflow: could not draw the plots (%s: %s)", type(err).__name__, err)
                return False
