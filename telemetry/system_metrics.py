"""CPU, memory, disk, network and (when pynvml finds one) GPU metrics of each process's machine, in the job's run.

MLflow's own monitor does the sampling. `mlflow.start_run(log_system_metrics=True)` would start it too, but only
for the fluent API's active run, whose exit hook ends that run when the process exits: a generator would end the
learner's run. So each process constructs the monitor that `start_run` constructs, for the job's run id, with its
own node id: the metrics land as `system/<node>/cpu_utilization_percentage` etc., the learner's under
`system/learner/`, each generator's under `system/<generator id>/`. The monitor stops by itself when the run ends.
"""
import logging

log = logging.getLogger(__name__)


def start_system_metrics(tracking_uri: str, run_id: str, node_id: str, every_s: float):
    """The running monitor, or None when `every_s` is 0 or it cannot start (telemetry never stops a job)."""
    if every_s <= 0:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # resume_logging: a restarted process carries on from its node's last step instead of overwriting step 0
        monitor = SystemMetricsMonitor(run_id, sampling_interval=every_s, samples_before_logging=1,
                                       resume_logging=True, node_id=node_id, tracking_uri=tracking_uri)
        monitor.start()
        return monitor
    except Exception as err:  # psutil missing, or the tracking server unreachable
        log.warning("mlflow: system metrics for %s are off (%s)", node_id, err)
        return None


def stop_system_metrics(monitor) -> None:
    if monitor is not None:
        monitor.finish()
