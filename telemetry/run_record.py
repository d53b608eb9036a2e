"""The job's record, kept by rank 0 of the learner: the MLflow run (params, the resolved config, every step's
metrics, evaluations, system metrics, plots), the progress line and progress.jsonl, and two files in the job
directory that outlive the run: trained_groups.jsonl (the audit trail) and summary.json.

It imports nothing else of asyncrl (telemetry's import rule): the learner hands it plain values, params and the
config as YAML text, so the record never decides anything about training. Built first and closed last, so every
other part's failure still ends the run with a status instead of leaving it RUNNING.
"""
import json
import os
import time
from collections.abc import Mapping

from asyncrl.telemetry.config import TelemetryConfig
from asyncrl.telemetry.mlflow_logger import MetricsLogger, create_or_attach_run, resolve_tracking_uri
from asyncrl.telemetry.plots import PlotPublisher
from asyncrl.telemetry.progress import ProgressDisplay
from asyncrl.telemetry.system_metrics import start_system_metrics, stop_system_metrics
from asyncrl.telemetry.timing import share
from asyncrl.telemetry.trackers import open_job_trackers

DROP_REASONS = ("stale", "zero_variance", "no_baseline", "empty", "poisoned_step")
"""Why a taken group is not trained: collect_batch's filters (learner/collect.py) and a step it poisoned
(learner/loop.py::skip_poisoned_step); each is in every step's progress.jsonl row, also when it is 0 (MLflow gets
it when it changes: telemetry/counters.py)."""
REJECTED_PREFIX = "buffer/rejected/"
SAMPLE_COLUMNS = ("step", "group", "generator", "prompt", "completion", "reward", "finish_reason", "version",
                  "staleness")
"""The columns of the run's samples/trained table (RunRecord.log_samples)."""
EVAL_SAMPLE_COLUMNS = ("version", "prompt", "completion", "reward")
"""The columns of the run's samples/eval table (RunRecord.log_eval_samples)."""
EVAL_TABLE_ROWS = 512
"""Most rows one evaluation round adds to samples/eval (its first prompts, every sample of each)."""
TABLE_TEXT_CHARS = 2000
"""A prompt or completion longer than this is cut (with "...") in a table: it is for reading, not for the record."""


def batch_metrics(staleness: list, dropped: Mapping, dropped_total: Mapping) -> dict:
    """The batch's staleness (mean, max over its groups) and the groups dropped while assembling it (this step
    and since the job started), one key per DROP_REASONS entry whether or not it happened."""
    metrics = {"buffer/staleness/mean": sum(staleness) / len(staleness),
               "buffer/staleness/max": float(max(staleness))}
    for reason in DROP_REASONS:
        metrics[f"buffer/dropped/{reason}"] = float(dropped.get(reason, 0))
        metrics[f"buffer/dropped_total/{reason}"] = float(dropped_total.get(reason, 0))
    metrics["buffer/dropped_stale"] = float(dropped.get("stale", 0))
    return metrics


class RunRecord:
    """Rank 0's record of the job. `job_name` names the MLflow run; `total_steps` sizes the progress line;
    `decode` (token ids -> text) writes the samples tables, which are off without it; `resume_run_id`: the MLflow
    run a resumed learner's checkpoint names, which it goes on logging into."""

    def __init__(self, telemetry: TelemetryConfig, job_name: str, job_dir: str, total_steps: int, decode=None,
                 resume_run_id: str = ""):
        self.job_dir = job_dir
        self.decode = decode
        self.samples_every = telemetry.samples_every if decode is not None else 0
        self.samples_groups = telemetry.samples_groups
        self.tracking_uri = resolve_tracking_uri(telemetry.tracking_uri)
        self.run_id = create_or_attach_run(self.tracking_uri, telemetry.experiment, job_name, resume_run_id)
        self.trackers = None
        self.metrics_log = MetricsLogger(self.tracking_uri, self.run_id, overview=True)
        self.system_metrics, self.plots, self.progress = None, None, None
        try:
            self.trackers = self.metrics_log.trackers = open_job_trackers(telemetry, job_dir, job_name)
            self.experiment_id = self.metrics_log.client.get_run(self.run_id).info.experiment_id
            self.system_metrics = start_system_metrics(self.tracking_uri, self.run_id, "learner",
                                                       telemetry.system_metrics_every_s)
            self.plots = (PlotPublisher(self.tracking_uri, self.run_id, job_dir, telemetry.plots_every_s)
                          if telemetry.plots else None)
            self.progress = ProgressDisplay(total_steps, os.path.join(job_dir, "progress.jsonl"),
                                            enabled=telemetry.progress)
        except BaseException:
            self.close("FAILED")
            raise
        self.groups_path = os.path.join(job_dir, "trained_groups.jsonl")
        self.rewards: list = []  # per step: the trained groups' reward (reward/mean)
        self.sampled_rewards: list = []  # per step: every sampled group's (reward/sampled_mean), where known
        self.eval_history: list = []  # each finished evaluation's metrics, for the summary
        self.rejected: dict = {}  # reason -> groups, as of the last step (for the summary)
        self._step_ended = time.monotonic()  # reset by start_clock(); a step runs from the previous step's end

    def write_config(self, params: dict, config_yaml: str) -> None:
        """The run's params, the resolved config as an artifact, and job_dir/config.yaml (what `asyncrl plan
        --from-run` reads)."""
        self.metrics_log.log_params(params)
        self.metrics_log.log_text(config_yaml, "config/resolved.yaml")
        self.trackers.log_params(params, config_yaml)
        with open(os.path.join(self.job_dir, "config.yaml"), "w") as handle:
            handle.write(config_yaml)

    def start_clock(self) -> None:
        """The first step's wall time runs from here (the buffer is up, generators may be admitted)."""
        self._step_ended = time.monotonic()

    def log(self, metrics: dict, step: int) -> None:
        self.metrics_log.log(metrics, step=step)

    def log_eval(self, step: int, metrics: dict) -> None:
        """A finished evaluation, at the step it evaluated; summary.json lists it under `eval`."""
        self.metrics_log.log(metrics, step=step)
        self.eval_history.append({"step": step, **metrics})

    def log_step(self, step: int, groups: list, metrics: dict, wait_s: float, staleness: list) -> None:
        """A trained step: its audit line (`staleness`: each group's, in order), the rejections counted in its
        buffer metrics (kept for the summary), the wait for the batch and its share of the step's wall time, then
        MLflow, the progress line and the plots."""
        self.record_groups(step, groups, staleness)
        self.rejected = {key[len(REJECTED_PREFIX):]: int(value) for key, value in metrics.items()
                         if key.startswith(REJECTED_PREFIX)}
        metrics["timing/learner/wait_for_batch_s"] = wait_s
        now = time.monotonic()  # the wait's share of the whole step: collect, train, publish, log
        metrics["timing/learner/idle_frac"] = share(wait_s, now - self._step_ended)
        self._step_ended = now
        self.rewards.append(metrics["reward/mean"])
        if "reward/sampled_mean" in metrics:
            self.sampled_rewards.append(metrics["reward/sampled_mean"])
        self.metrics_log.log(metrics, step=step)
        if self.samples_every and step % self.samples_every == 0:
            self.log_samples(step, groups[:self.samples_groups], staleness)
        self.progress.update(step, metrics)
        if self.plots is not None:
            self.plots.after_step()

    def log_samples(self, step: int, groups: list, staleness: list) -> None:
        """Every sample of `groups` as rows of the run's samples/trained table: what a person reads to see what the
        policy writes and how it is scored (the text decoded here, cut at TABLE_TEXT_CHARS)."""
        rows = []
        for group, stale in zip(groups, staleness):
            prompt = clip(self.decode(group.prompt_ids.tolist()))
            for sample in group.samples:
                version = int(sample.versions.min()) if len(sample.versions) else None
                rows.append([step, group.group_id, group.generator_id, prompt,
                             clip(self.decode(sample.completion_ids.tolist())), float(sample.reward),
                             sample.finish_reason, version, int(stale)])
        if rows:
            self.metrics_log.log_table("samples/trained", list(SAMPLE_COLUMNS), rows, step)

    def log_eval_samples(self, version: int, samples: list) -> None:
        """An evaluation round's samples as rows of the run's samples/eval table, at the version it evaluated:
        `samples` is (prompt token ids, completion texts, rewards) per prompt (the generators send the texts)."""
        if self.decode is None:
            return
        rows = []
        for prompt_ids, texts, rewards in samples:
            prompt = clip(self.decode(list(prompt_ids)))
            rows += [[version, prompt, clip(text), float(reward)] for text, reward in zip(texts, rewards)]
        if rows:
            self.metrics_log.log_table("samples/eval", list(EVAL_SAMPLE_COLUMNS), rows[:EVAL_TABLE_ROWS], version)

    def record_groups(self, step: int, groups: list, staleness: list) -> None:
        """job_dir/trained_groups.jsonl: which groups, of which prompts, each step trained on (an audit trail:
        with the Redis backend every admitted group appears exactly once across restarts; with dealt prompts,
        every prompt once per epoch, counting for each step the learner's last life that trained it), the
        generator that sent each and its staleness (what bench/soak/history.py checks), and each sample's
        completion length, the distribution `asyncrl plan` simulates."""
        record = {"step": step, "groups": [group.group_id for group in groups],
                  "prompts": [group.prompt_id for group in groups],
                  "generators": [group.generator_id for group in groups], "staleness": list(staleness),
                  "lengths": [[len(sample.completion_ids) for sample in group.samples] for group in groups]}
        with open(self.groups_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def close(self, status: str) -> None:
        """Stops what runs in the background, flushes, draws the final plots, and ends the run with `status`."""
        if self.progress is not None:
            self.progress.close()
        stop_system_metrics(self.system_metrics)
        try:
            self.metrics_log.close()  # flushed, so the final plots read every point
            if self.trackers is not None:
                self.trackers.close(status)
            if self.plots is not None:
                self.plots.refresh()
        finally:
            self.metrics_log.end_run(status)

    def summary(self, start_version: int, dropped_total: Mapping, generators) -> dict:
        """job_dir/summary.json: the reward at the start and the end (the mean over the first and the last tenth of
        the steps) of every group sampled and of the trained groups, named apart (buffer/sampled.py: dynamic
        sampling leaves the all-alike groups out of the trained ones), what was rejected (as of the last step) and
        dropped, who joined (`generators`, read by the caller before the buffer closed), the evaluations."""
        window = max(1, len(self.rewards) // 10)
        summary = {
            "steps": len(self.rewards),
            "start_version": start_version,
            **first_and_last("sampled_reward", self.sampled_rewards, window),
            **first_and_last("trained_reward", self.rewards, window),
            "reward_window_steps": window,
            "rejected": dict(self.rejected),
            "dropped": dict(dropped_total),
            "generators": generators,
            "eval": self.eval_history,
            "mlflow_tracking_uri": self.tracking_uri,
            "mlflow_run_id": self.run_id,
            "mlflow_experiment_id": self.experiment_id,
        }
        with open(os.path.join(self.job_dir, "summary.json"), "w") as handle:
            json.dump(summary, handle, indent=2)
        return summary


def clip(text: str) -> str:
    return text if len(text) <= TABLE_TEXT_CHARS else text[:TABLE_TEXT_CHARS] + "..."


def first_and_last(name: str, values: list, window: int) -> dict:
    """`<name>_first` and `<name>_last`: the means of the first and the last `window` values (None when none)."""
    head, tail = values[:window], values[-window:]
    return {f"{name}_first": sum(head) / len(head) if head else None,
            f"{name}_last": sum(tail) / len(tail) if tail else None}
