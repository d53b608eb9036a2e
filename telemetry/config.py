"""Telemetry settings (stdlib only)."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class TelemetryConfig:
    tracking_uri: Optional[str] = None
    """MLflow tracking URI. None: $MLFLOW_TRACKING_URI if set, else sqlite:///mlflow.db in the working directory."""
    experiment: str = "asyncrl"
    """MLflow experiment that holds the job's run."""
    progress: bool = True
    """Show the live progress line."""

    def __post_init__(self):
        if not self.experiment:
            raise ValueError("telemetry.experiment must not be empty")
