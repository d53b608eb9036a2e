"""Telemetry settings (stdlib only)."""
from dataclasses import dataclass, field
from typing import List, Optional

LOGGERS = ("mlflow", "tensorboard", "wandb", "swanlab")
"""What telemetry.loggers may name (telemetry/trackers.py); mlflow is always first."""


@dataclass
class TelemetryConfig:
    tracking_uri: Optional[str] = None
    """MLflow tracking URI. None: $MLFLOW_TRACKING_URI if set, else sqlite:///mlflow.db in the working directory."""
    experiment: str = "asyncrl"
    """MLflow experiment that holds the job's run."""
    progress: bool = True
    """Show the live progress line."""
    system_metrics_every_s: float = 10.0
    """Seconds between samples of each process's CPU, memory, disk, network and GPU (MLflow's system metrics, under
    system/<learner or generator id>/). 0: off."""
    plots: bool = True
    """Draw the dashboards (reward, staleness, off-policy, throughput) as PNG artifacts under plots/ in the run."""
    plots_every_s: float = 300.0
    """Redraw them this often (seconds, checked after each step), and at the end. 0: only at the end. A redraw
    takes a few seconds of one core, off the training thread."""
    serve: bool = False
    """`asyncrl run` starts an MLflow tracking server on the job's store and everything logs through it: what
    generators on other hosts need (a sqlite file is local to one machine). The learner publishes its address."""
    serve_host: str = "127.0.0.1"
    """Where the tracking server listens. Only a trusted network should reach it: MLflow's server has no
    authentication of its own."""
    serve_port: int = 0
    """Its port; 0: a free one."""
    loggers: List[str] = field(default_factory=lambda: ["mlflow"])
    """Where the learner's (and `asyncrl sft`'s) metrics go: mlflow, always first (the job's record), then any of
    tensorboard, wandb, swanlab (the `trackers` extra), each a copy with the same metric names. Their failures
    never stop training (telemetry/trackers.py)."""
    tracker_dir: Optional[str] = None
    """Where TensorBoard's event files and W&B's and SwanLab's local run folders go; None: the job directory's
    trackers/."""
    samples_every: int = 50
    """Every this many steps, a few of the step's trained groups (prompt, completion, reward, version, staleness)
    are appended to the run's table samples/trained.json, and to the other trackers' tables; 0: off."""
    samples_groups: int = 2
    """How many of the step's groups go into that table (every sample of each)."""
    project: Optional[str] = None
    """The W&B and SwanLab project; None: telemetry.experiment. Their run is named after job.name, as MLflow's is."""

    def __post_init__(self):
        if not self.experiment:
            raise ValueError("telemetry.experiment must not be empty")
        if self.system_metrics_every_s < 0 or self.plots_every_s < 0:
            raise ValueError("telemetry.system_metrics_every_s and telemetry.plots_every_s must be >= 0 (0: off, "
                             f"or only at the end); got {self.system_metrics_every_s}, {self.plots_every_s}")
        if self.serve and (self.tracking_uri or "").startswith(("http://", "https://")):
            raise ValueError(f"telemetry.serve starts a tracking server on a local store, and telemetry.tracking_uri "
                             f"is already a server ({self.tracking_uri}): leave telemetry.serve off to log there")
        check_loggers(list(self.loggers))
        if self.samples_every < 0 or self.samples_groups < 1:
            raise ValueError(f"telemetry.samples_every must be >= 0 (0: off) and telemetry.samples_groups >= 1; got "
                             f"{self.samples_every}, {self.samples_groups}")
        if not 0 <= self.serve_port <= 65535:
            raise ValueError(f"telemetry.serve_port must be a port number (0: a free one), got {self.serve_port}")


def check_loggers(loggers: list) -> None:
    """telemetry.loggers is valid: known names, each once, MLflow first (the job's record cannot be turned off)."""
    unknown = [name for name in loggers if name not in LOGGERS]
    if unknown:
        raise ValueError(f"telemetry.loggers: unknown {unknown}; choose from {list(LOGGERS)}")
    if len(set(loggers)) != len(loggers):
        raise ValueError(f"telemetry.loggers names a tracker twice: {loggers}")
    if not loggers or loggers[0] != "mlflow":
        raise ValueError(f"telemetry.loggers must start with mlflow (the job's record: generators, plots and `asyncrl "
                         f"plan --from-run` read it), then any of {list(LOGGERS[1:])}; got {loggers}")
