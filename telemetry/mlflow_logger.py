"""MLflow tracking shared by every process of a job: one run, asynchronous logging off the hot path.

The learner creates the run (or attaches to $MLFLOW_RUN_ID) and hands its id to generators. Everyone logs with
`MlflowClient.log_batch` from a background thread: never the fluent `start_run`, whose exit hook would end the
shared run. The queue is bounded; when it is full the oldest report is dropped and counted rather than blocking
training: the newest report is the one a person watching the run needs (`DropOldestQueue`). A metric that is
not finite (a NaN loss) cannot be stored as a point, so it is never dropped in silence: each such key is warned
about once, and every report that had any logs `telemetry/non_finite_metrics` with how many. Counters reach the run
only when they change (telemetry/counters.py): flat-zero charts would bury the ones that matter.
"""
import collections
import logging
import os
import threading
import time
from dataclasses import dataclass

from asyncrl.telemetry.counters import CounterFilter
from asyncrl.telemetry.overview import with_overview

log = logging.getLogger(__name__)
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def resolve_tracking_uri(configured: str | None) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI, else the default; a relative sqlite path made absolute, so
    the learner publishes one that a generator started elsewhere on this machine finds."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////") and uri != "sqlite:///:memory:":
        uri = "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return uri


def is_local_store(uri: str) -> bool:
    """A store that is a file on one machine (sqlite, or a directory), which only processes there can log into."""
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The experiment tag MLflow's UI reads to pick its view: GenAI (traces, evaluations) or model training (runs,
metric charts). Without it, MLflow 3 opens an experiment in the GenAI view."""
MODEL_TRAINING_KIND = "custom_model_development"
"""The tag's value for MLflow's model-training view, where an RL job's metric charts are."""


def create_or_attach_run(tracking_uri: str, experiment: str, run_name: str, resume_run_id: str = "") -> str:
    """The job's run id: $MLFLOW_RUN_ID when set (attach); else `resume_run_id`, the run a resumed learner's
    checkpoint names, marked running again, when this tracking store has it; else a new run in `experiment`. The
    experiment is tagged as model training when asyncrl creates it, or finds it untagged; a kind someone chose is
    kept."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    existing = os.environ.get("MLFLOW_RUN_ID")
    if existing:
        client.get_run(existing)  # fails clearly if the id is unknown to this tracking store
        return existing
    if resume_run_id:
        try:
            if client.get_run(resume_run_id).info.lifecycle_stage == "active":
                client.update_run(resume_run_id, status="RUNNING")
                return resume_run_id
            log.warning("MLflow run %s of the checkpoint was deleted: this life logs to a new run", resume_run_id)
        except MlflowException as err:
            log.warning("MLflow run %s of the checkpoint is not in %s (%s): this life logs to a new run",
                        resume_run_id, tracking_uri, str(err).splitlines()[0])
    found = client.get_experiment_by_name(experiment)
    if found is None:
        experiment_id = client.create_experiment(experiment, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
    else:
        experiment_id = found.experiment_id
        if EXPERIMENT_KIND_TAG not in found.tags:
            client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
    return client.create_run(experiment_id, run_name=run_name).info.run_id


class DropOldestQueue:
    """A bounded FIFO whose `put` never blocks: when it is full, the oldest item makes room and is counted.
    Any number of producers, one consumer."""

    def __init__(self, maxsize: int):
        self._items: collections.deque = collections.deque()
        self._maxsize = maxsize
        self._ready = threading.Condition()
        self.dropped = 0

    def put(self, item) -> None:
        with self._ready:
            if len(self._items) >= self._maxsize:
                self._items.popleft()
                self.dropped += 1
            self._items.append(item)
            self._ready.notify()

    def get(self):
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()


@dataclass
class TableReport:
    """Rows for a table of the run (`<name>.json`, appended to at each report), queued like a metrics report."""

    name: str
    columns: list
    rows: list
    step: int


class MetricsLogger:
    """Consumes metric dicts from any thread; a daemon thread writes them in batches of <= 1000."""

    def __init__(self, tracking_uri: str, run_id: str, prefix: str = "", max_pending: int = 1000,
                 overview: bool = False, trackers=None):
        """`overview`: also log the first charts a person looks for under `RL overview/` (telemetry/overview.py);
        the learner's logger does. `trackers`: telemetry/trackers.py::Trackers, the other trackers that get a copy
        of every report (from this logger's thread, after MLflow); their owner closes them."""
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self.prefix = prefix
        self.overview = overview
        self.trackers = trackers
        self._queue = DropOldestQueue(max_pending)
        self.non_finite = 0  # metric values that were NaN or inf
        self._warned: set = set()  # keys already warned about
        self._counters = CounterFilter()  # used by the drain thread only
        self._thread = threading.Thread(target=self._drain, name="asyncrl-mlflow", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Reports dropped because the queue was full (MLflow slower than the metrics)."""
        return self._queue.dropped

    def log(self, metrics: dict, step: int) -> None:
        self._queue.put((dict(metrics), step, int(time.time() * 1000)))

    def log_table(self, name: str, columns: list, rows: list, step: int) -> None:
        """Rows (one list per row, in `columns`' order) appended to the run's table `<name>.json` (MLflow's
        `log_table`: the run's Artifacts and Evaluation views show it) and to the other trackers' tables, from the
        logging thread: each append rewrites MLflow's artifact, never on the training path."""
        self._queue.put(TableReport(name, list(columns), [list(row) for row in rows], step))

    def log_params(self, params: dict) -> None:
        """The params the run does not hold yet. A resumed learner logs into the run it left (its config may have
        changed: more steps, another resume point), and MLflow refuses to change a param: a changed value becomes
        the tag `resumed_with/<key>`, and the log says which."""
        from mlflow.entities import Param, RunTag

        held = self.client.get_run(self.run_id).data.params
        values = {key: str(value)[:6000] for key, value in params.items()}
        items = [Param(key, value) for key, value in values.items() if key not in held]
        changed = [RunTag(f"resumed_with/{key}", value) for key, value in values.items()
                   if key in held and held[key] != value]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])
        for start in range(0, len(changed), 100):
            self.client.log_batch(self.run_id, tags=changed[start : start + 100])
        if changed:
            log.info("mlflow: the resumed job's config differs from the run's params in %s (tags resumed_with/...)",
                     ", ".join(tag.key.split("/", 1)[1] for tag in changed))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def _drain(self) -> None:
        from mlflow.entities import Metric

        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, TableReport):
                self._write_table(item)
                continue
            metrics, step, stamp = item
            metrics = self._counters.keep(metrics)
            if self.overview:
                metrics = with_overview(metrics)
            batch = [Metric(self.prefix + k, float(v), stamp, step) for k, v in metrics.items() if _is_number(v)]
            non_finite = [k for k, v in metrics.items() if _is_real(v) and not _is_number(v)]
            if non_finite:
                batch.append(Metric(self.prefix + "telemetry/non_finite_metrics", float(len(non_finite)), stamp, step))
                self._warn_non_finite(non_finite, metrics, step)
            for start in range(0, len(batch), 1000):
                self._write(batch[start : start + 1000])
            if self.trackers is not None:
                self.trackers.log({self.prefix + k: float(v) for k, v in metrics.items() if _is_number(v)}, step)

    def _write_table(self, table: TableReport) -> None:
        try:
            self.client.log_table(self.run_id, {column: [row[i] for row in table.rows]
                                                for i, column in enumerate(table.columns)},
                                  artifact_file=f"{self.prefix}{table.name}.json")
        except Exception as err:  # noqa: BLE001 - a table is for reading; training never waits on it
            log.warning("mlflow: could not log the table %s at step %d: %s", table.name, table.step, err)
        if self.trackers is not None:
            self.trackers.log_table(self.prefix + table.name, table.columns, table.rows, table.step)

    def _warn_non_finite(self, keys: list, metrics: dict, step: int) -> None:
        self.non_finite += len(keys)
        new = [key for key in keys if key not in self._warned]
        if new:
            self._warned.update(new)
            log.warning("mlflow: step %d: %s not finite (%s); MLflow cannot store them, so they are counted under "
                        "%stelemetry/non_finite_metrics", step, ", ".join(new[:8]),
                        ", ".join(f"{key}={metrics[key]}" for key in new[:3]), self.prefix)

    def _write(self, batch: list) -> None:
        for attempt in range(3):  # sqlite may be briefly locked by another process of the job
            try:
                self.client.log_batch(self.run_id, metrics=batch)
                return
            except Exception as err:
                if attempt == 2:
                    log.warning("mlflow: could not log %d metrics: %s", len(batch), err)
                time.sleep(0.2 * (attempt + 1))

    def close(self, status: str | None = None) -> None:
        """Flush everything queued, then optionally end the run (only its creator does that)."""
        self._queue.put(None)  # the newest item: only a full queue drops it, and nothing logs after close
        self._thread.join(timeout=60)
        if status is not None:
            self.end_run(status)

    def end_run(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def _is_real(value) -> bool:
    """A number of any value, NaN and inf included (bools and strings are not metrics)."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (bool, str))


def _is_number(value) -> bool:
    try:
        return value == value and abs(float(value)) != float("inf")
    except (TypeError, ValueError):
        return False
