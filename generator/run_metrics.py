"""The generator's side of the job's MLflow run: its metrics (`<generator id>/...`, at the engine's weight version as
the step) and its system metrics, logged into the run the learner named in its hello reply.

A learner resumed from its checkpoint opens a run of its own (telemetry/run_record.py), and a generator that waited
for it (generator/rollout.py) carries on: `follow` moves the metrics to the run the resumed learner names, so they
sit beside that learner's, not in the dead one's run.
"""
import logging
import socket

from asyncrl.buffer.interface import RunInfo
from asyncrl.telemetry.system_metrics import start_system_metrics, stop_system_metrics

log = logging.getLogger(__name__)


class GeneratorRunMetrics:
    def __init__(self, generator_id: str, system_metrics_every_s: float):
        self.generator_id = generator_id
        self.system_metrics_every_s = system_metrics_every_s
        self.run_id: str | None = None
        self._logger = None
        self._system = None

    def follow(self, info: RunInfo | None) -> None:
        """Log into the run `info` names from now on (nothing changes when it is the run already followed)."""
        if info is None or not info.mlflow_run_id or info.mlflow_run_id == self.run_id:
            return
        previous = self.run_id
        self.close()
        self.run_id = info.mlflow_run_id
        self._logger = metrics_logger(info, self.generator_id)
        if self._logger is not None:
            self._system = start_system_metrics(info.tracking_uri, info.mlflow_run_id, self.generator_id,
                                                self.system_metrics_every_s)
        if previous is not None:
            log.info("generator %s: metrics go to the resumed learner's MLflow run %s", self.generator_id,
                     self.run_id)

    def log(self, metrics: dict, step: int) -> None:
        if self._logger is not None:
            self._logger.log(metrics, step=step)

    def close(self) -> None:
        stop_system_metrics(self._system)
        if self._logger is not None:
            self._logger.close()
        self._logger, self._system = None, None


def metrics_logger(info: RunInfo, generator_id: str):
    """The logger into the learner's run, or None when that cannot work: the learner's store is a file on another
    machine (telemetry.serve is the way), or MLflow does not answer."""
    from asyncrl.telemetry.mlflow_logger import MetricsLogger, is_local_store

    learner_host = info.host
    if is_local_store(info.tracking_uri) and learner_host and learner_host != socket.gethostname():
        log.warning("generator %s: the learner logs to %s, a file on %s; this generator's metrics stay out of the "
                    "run (start the job with telemetry.serve=true, or set telemetry.tracking_uri to a tracking "
                    "server)", generator_id, info.tracking_uri, learner_host)
        return None
    try:
        return MetricsLogger(info.tracking_uri, info.mlflow_run_id, prefix=f"{generator_id}/")
    except Exception as err:  # telemetry must never stop generation
        log.warning("generator %s: MLflow unavailable (%s); metrics go to the learner only", generator_id, err)
        return None
