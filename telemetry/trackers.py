"""The trackers beside MLflow (telemetry.loggers): TensorBoard, Weights & Biases and SwanLab, for people whose
dashboards already live there.

MLflow stays the job's record: generators log into the learner's run, the plots, `asyncrl plan --from-run` and the
soak's checker read it. The others get a copy of the learner's metrics (and the SFT job's), with the same names, the
`RL overview/` section included, from the same background thread that writes MLflow (mlflow_logger.py), so none of
them is ever on the training path. Generators log to MLflow only: the learner's metrics already carry the fleet's
aggregates (rollout reward, generator tokens/s and idle), and each of these trackers wants one writer per run.

No tracker's failure stops training. A tracker whose package is missing is a clear error when the job starts (the
recipe asked for it; `pip install asyncrl[trackers]`); one that fails to open, or fails while logging, is warned
about and dropped, and the job goes on with MLflow and the rest.

Each tracker writes under its own folder of `telemetry.tracker_dir` (default: the job directory's `trackers/`):
- TensorBoard: `tensorboard/` event files (torch's SummaryWriter); `tensorboard --logdir <that folder>`.
- W&B: `wandb/`; online or offline as W&B's own settings say (WANDB_MODE, WANDB_API_KEY, ...): offline runs are
  uploaded later with `wandb sync`. Steps go on a metric of their own (`step`), so an evaluation logged at the
  earlier step it evaluated is kept: W&B's own step only moves forward.
- SwanLab: `swanlog/`; its mode from SWANLAB_MODE (`offline`, `local`, `online`, ...), else `offline`: a run never
  tries to reach SwanLab's cloud unless told to. It keeps, per metric, only steps that move forward.
"""
import logging
import os

log = logging.getLogger(__name__)

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}
"""The package each tracker needs (the `trackers` extra installs them all)."""
FAILURES_BEFORE_DROP = 3
"""A tracker that fails this many reports in a row is closed and left out for the rest of the job."""


def require_packages(loggers: list) -> None:
    """Each named tracker's package imports; else a clear error naming the extra, before anything starts."""
    import importlib

    missing = []
    for name in loggers:
        if name in PACKAGES:
            try:
                importlib.import_module(PACKAGES[name])
            except ImportError:
                missing.append(PACKAGES[name])
    if missing:
        raise RuntimeError(f"telemetry.loggers asks for {', '.join(missing)}, which is not installed: pip install "
                           f"'asyncrl[trackers]' (or {' '.join(missing)})")


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, folder: str, run_name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(folder, "tensorboard", run_name), flush_secs=30)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_table(self, name: str, columns: list, rows: list, step: int) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), global_step=step)

    def log_params(self, params: dict, config_yaml: str) -> None:
        # TensorBoard has no params table outside its HParams plugin, which wants final metrics: the resolved
        # config as text, where a person looks for it
        self.writer.add_text("config/resolved.yaml", "```\n" + config_yaml + "\n```", global_step=0)

    def close(self, status: str) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, folder: str, run_name: str, project: str):
        import wandb

        path = os.path.join(folder, "wandb")
        os.makedirs(path, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, dir=path, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({"step": step, **metrics})

    def log_table(self, name: str, columns: list, rows: list, step: int) -> None:
        import wandb

        self.run.log({"step": step, name: wandb.Table(columns=list(columns), data=[list(row) for row in rows])})

    def log_params(self, params: dict, config_yaml: str) -> None:
        self.run.config.update(params, allow_val_change=True)

    def close(self, status: str) -> None:
        import wandb

        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        # finish() returns before W&B's service has written the run's file out; teardown waits for the service to
        # stop, so the run is whole on disk (for `wandb sync`) when the job says it ended. The job has one run.
        wandb.teardown()


class SwanLabTracker:
    name = "swanlab"

    def __init__(self, folder: str, run_name: str, project: str):
        import swanlab

        settings = swanlab.Settings(interactive=False, terminal=swanlab.Settings.Terminal(proxy_type="none"),
                                    probe=swanlab.Settings.Probe(monitor=False))
        self.run = swanlab.init(project=project, name=run_name, log_dir=os.path.join(folder, "swanlog"),
                                mode=os.environ.get("SWANLAB_MODE") or "offline", settings=settings, reinit=True)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, columns: list, rows: list, step: int) -> None:
        import swanlab

        table = swanlab.echarts.Table()
        table.add(list(columns), [list(row) for row in rows])
        self.run.log({name: table}, step=step)

    def log_params(self, params: dict, config_yaml: str) -> None:
        self.run.config.update(params)

    def close(self, status: str) -> None:
        if status == "FINISHED":
            self.run.finish(state="success")
        else:
            self.run.finish(state="crashed", error=f"the job ended {status}")


def markdown_table(columns: list, rows: list) -> str:
    """A table as Markdown (TensorBoard's text plugin renders it); cells' pipes and newlines escaped."""
    def cell(value) -> str:
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def open_job_trackers(telemetry, job_dir: str, run_name: str) -> "Trackers":
    """The trackers a job's telemetry section names beside MLflow (telemetry/config.py), in telemetry.tracker_dir or
    the job directory's `trackers/`, under the W&B / SwanLab project telemetry.project (else the MLflow
    experiment's name)."""
    require_packages(telemetry.loggers)
    folder = os.path.expanduser(telemetry.tracker_dir or os.path.join(job_dir, "trackers"))
    return Trackers.open(telemetry.loggers, folder, run_name, telemetry.project or telemetry.experiment)


def open_tracker(name: str, folder: str, run_name: str, project: str):
    if name == "tensorboard":
        return TensorBoardTracker(folder, run_name)
    if name == "wandb":
        return WandbTracker(folder, run_name, project)
    if name == "swanlab":
        return SwanLabTracker(folder, run_name, project)
    raise ValueError(f"no tracker {name!r}")


class Trackers:
    """The trackers of one job beside MLflow; every call is isolated, so one tracker's failure costs only that
    tracker. `log` runs on MetricsLogger's drain thread; open and close on the job's."""

    def __init__(self, trackers: list):
        self.trackers = list(trackers)
        self._failures = {tracker.name: 0 for tracker in self.trackers}
        self.dropped: list = []  # names of the trackers left out after failing

    @classmethod
    def open(cls, loggers: list, folder: str, run_name: str, project: str) -> "Trackers":
        """The trackers `loggers` names beside mlflow, each opened in `folder`; one that fails to open is warned
        about and left out (their packages are checked first: require_packages)."""
        opened = []
        for name in loggers:
            if name == "mlflow":
                continue
            try:
                opened.append(open_tracker(name, folder, run_name, project))
            except Exception as err:  # noqa: BLE001 - a tracker never stops the job
                log.warning("telemetry: %s could not start (%s: %s); the job goes on without it", name,
                            type(err).__name__, err)
        if opened:
            log.info("telemetry: also logging to %s under %s", ", ".join(t.name for t in opened), folder)
        return cls(opened)

    def _call(self, tracker, what: str, *args) -> None:
        try:
            getattr(tracker, what)(*args)
            self._failures[tracker.name] = 0
        except Exception as err:  # noqa: BLE001 - a tracker never stops the job
            self._failures[tracker.name] += 1
            log.warning("telemetry: %s failed to %s (%s: %s)", tracker.name, what, type(err).__name__, err)
            if self._failures[tracker.name] >= FAILURES_BEFORE_DROP:
                self._drop(tracker)

    def _drop(self, tracker) -> None:
        log.warning("telemetry: %s failed %d times in a row; left out for the rest of the job", tracker.name,
                    FAILURES_BEFORE_DROP)
        self.trackers.remove(tracker)
        self.dropped.append(tracker.name)
        try:
            tracker.close("FAILED")
        except Exception:  # noqa: BLE001 - already given up on
            pass

    def log(self, metrics: dict, step: int) -> None:
        """`metrics`: finite numbers only (the caller filters what MLflow could not store either)."""
        for tracker in list(self.trackers):
            self._call(tracker, "log", metrics, step)

    def log_table(self, name: str, columns: list, rows: list, step: int) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, "log_table", name, columns, rows, step)

    def log_params(self, params: dict, config_yaml: str) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, "log_params", params, config_yaml)

    def close(self, status: str) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.close(status)
            except Exception as err:  # noqa: BLE001 - the job is ending; MLflow has the record
                log.warning("telemetry: %s failed to close (%s: %s)", tracker.name, type(err).__name__, err)
        self.trackers = []
