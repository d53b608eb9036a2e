"""What only rank 0 of the learner runs: the buffer (zmq server thread, or the Redis client), MLflow, the progress
display and the weight publisher, and the step's rank-0 bookkeeping (metrics, the audit trail, the summary)."""
import json
import logging
import os
import socket
import time

from asyncrl.buffer.backends import job_limits, make_learner_buffer
from asyncrl.buffer.dealer import DealError, PromptDealer
from asyncrl.buffer.eval_rounds import EvalRounds, eval_due, first_due
from asyncrl.buffer.interface import RunInfo
from asyncrl.configs import flatten, shared_hash, shared_sections, to_yaml
from asyncrl.data.prompts import PromptSet, encode_prompts
from asyncrl.learner.checkpoint import CheckpointError
from asyncrl.learner.model import model_positions
from asyncrl.learner.objective import resolved_hyperparameters
from asyncrl.learner.parallel import ParallelState
from asyncrl.learner.publish import repeats_previous
from asyncrl.learner.state import LearnerState
from asyncrl.learner.step_metrics import component_means
from asyncrl.telemetry.eval_metrics import eval_metrics
from asyncrl.telemetry.mlflow_logger import MetricsLogger, create_or_attach_run, resolve_tracking_uri
from asyncrl.telemetry.plots import PlotPublisher
from asyncrl.telemetry.progress import ProgressDisplay
from asyncrl.telemetry.system_metrics import start_system_metrics, stop_system_metrics
from asyncrl.telemetry.timing import share
from asyncrl.security.curve import server_keys
from asyncrl.weightsync.backends import make_publisher
from asyncrl.weightsync.model_files import ModelFilesError, pack

log = logging.getLogger(__name__)
DROP_REASONS = ("stale", "zero_variance", "no_baseline", "empty", "poisoned_step")
"""Why a taken group is not trained: collect_batch's filters (learner/collect.py) and a step it poisoned
(learner/loop.py::skip_poisoned_step); each is in every step's progress.jsonl row, also when it is 0 (MLflow gets
it when it changes: telemetry/counters.py)."""


class LearnerHost:
    def __init__(self, cfg, model, model_path: str, train_files: list, job_dir: str, parallel: ParallelState,
                 state: LearnerState, resumed_from: str | None, prompts: PromptSet | None = None,
                 eval_prompts: PromptSet | None = None):
        self.cfg = cfg
        self.job_dir = job_dir
        self.tracking_uri = resolve_tracking_uri(cfg.telemetry.tracking_uri)
        self.run_id = create_or_attach_run(self.tracking_uri, cfg.telemetry.experiment, cfg.job.name)
        self.metrics_log = MetricsLogger(self.tracking_uri, self.run_id, overview=True)
        self.experiment_id = self.metrics_log.client.get_run(self.run_id).info.experiment_id
        self.metrics_log.log_params({**flatten(cfg), **resolved_hyperparameters(cfg.algo),
                                     "learner.world_size": parallel.world_size, "learner.dp_size": parallel.dp_size})
        self.metrics_log.log_text(to_yaml(cfg), "config/resolved.yaml")
        with open(os.path.join(job_dir, "config.yaml"), "w") as handle:  # what `asyncrl plan --from-run` reads
            handle.write(to_yaml(cfg))
        telemetry = cfg.telemetry
        self.system_metrics = start_system_metrics(self.tracking_uri, self.run_id, "learner",
                                                   telemetry.system_metrics_every_s)
        self.plots = (PlotPublisher(self.tracking_uri, self.run_id, job_dir, telemetry.plots_every_s)
                      if telemetry.plots else None)
        self.publisher = make_publisher(cfg.weightsync, cfg.job.name, keys=server_keys(cfg.security.keys_dir))
        files = model_files_for(model_path)
        if files is not None:  # a generator on another host starts from these and the weights it is sent
            self.publisher.catchup.serve_files(*files)
        self.overlong_prompts = 0
        self.dealer = self._build_dealer(prompts, state.data_cursor)
        self.evals = self._build_evals(eval_prompts)
        run_info = RunInfo(
            model_path=os.path.abspath(model_path), train_files=tuple(os.path.abspath(f) for f in train_files),
            mlflow_run_id=self.run_id, tracking_uri=self.tracking_uri, host=socket.gethostname(),
            job_dir=os.path.abspath(job_dir), job=cfg.job.name, model_files=files[1] if files is not None else "",
            lora_rank=cfg.learner.lora.rank if cfg.learner.lora.enabled else 0,  # engines size adapter slots by it
            deals=self.dealer is not None,  # generators sample what they are dealt and need no copy of the data
            data_sources=tuple(self.dealer.data_sources) if self.dealer is not None else (),
            deal_timeout_s=cfg.data.deal_timeout_s,
            evals=self.evals is not None)  # a Redis generator asks for evaluation prompts only then
        limits = job_limits(cfg.rollout, cfg.data.max_prompt_tokens, model_positions(model),
                            episodes=cfg.samples_episodes())
        self.buffer = make_learner_buffer(cfg.buffer, cfg.security, cfg.job.name, limits,
                                          vocab_size=model.get_input_embeddings().num_embeddings,
                                          config_hash=shared_hash(cfg),
                                          shared_config=shared_sections(cfg), run_info=run_info,
                                          start_version=state.version, fresh=resumed_from is None,
                                          dealer=self.dealer, evals=self.evals)
        if self.dealer is not None:  # with Redis the cursor lives there (buffer/redis/dealing.py)
            self.dealer = self.buffer.dealer
        self.version = state.version  # the newest published; how far training moved on when an evaluation lands
        self._next_eval = first_due(state.version, cfg.eval.every_steps)
        self.groups_path = os.path.join(job_dir, "trained_groups.jsonl")
        self.progress = ProgressDisplay(cfg.learner.total_steps, os.path.join(job_dir, "progress.jsonl"),
                                        enabled=cfg.telemetry.progress)
        self.rewards: list = []
        self.eval_history: list = []  # each finished evaluation's metrics, for the summary
        self.rejected: dict = {}  # reason -> groups, as of the last step (for the summary)
        self._step_ended = time.monotonic()  # reset by start(); a step's wall time runs from the previous step's end
        self._last_published: tuple | None = None  # (fingerprint, checksums) of the last version published
        self.unchanged_versions = 0  # versions published with the previous one's bytes after a trained step
        self.publish_metrics: dict = {}  # the last publish's bytes, logged with the step that published it
        if resumed_from is not None:
            log.info("learner: resumed from %s at version %d", resumed_from, state.version)

    def _build_dealer(self, prompts: PromptSet | None, cursor: dict) -> PromptDealer | None:
        """The prompts dealt with the admissions (buffer/dealer.py), carrying on from the checkpoint's cursor (with
        Redis, from the cursor in Redis; the checkpoint's serves only a Redis that lost it). None without data (a
        learner fed by scripted generators)."""
        if prompts is None:
            return None
        data = self.cfg.data
        self.overlong_prompts = prompts.overlong
        if self.overlong_prompts:
            log.warning("learner: %d prompts longer than data.max_prompt_tokens=%d are left out", self.overlong_prompts,
                        data.max_prompt_tokens)
        dealer = PromptDealer(encode_prompts(prompts.rows), shuffle=data.shuffle,
                              seed=self.cfg.job.seed if data.seed is None else data.seed, epochs=data.epochs,
                              timeout_s=data.deal_timeout_s)
        if cursor:
            try:
                dealer.restore(cursor)
            except DealError as err:
                raise CheckpointError(str(err)) from None
        log.info("learner: dealing %d prompts (epoch %.2f%s)", dealer.size, dealer.metrics()["data/epoch"],
                 f" of {data.epochs}" if data.epochs else "")
        return dealer

    def _build_evals(self, eval_prompts: PromptSet | None) -> EvalRounds | None:
        """The held-out prompts evaluated on the fleet during training (buffer/eval_rounds.py); None when
        eval.every_steps and eval.before_train are off or there are no eval prompts."""
        if eval_prompts is None:
            return None
        if eval_prompts.overlong:
            log.warning("learner: %d eval prompts longer than data.max_prompt_tokens are left out",
                        eval_prompts.overlong)
        log.info("learner: evaluating %d held-out prompts every %d steps on the fleet", len(eval_prompts.rows),
                 self.cfg.eval.every_steps)
        return EvalRounds(encode_prompts(eval_prompts.rows), self.cfg.eval.timeout_s)

    def _open_eval_if_due(self, version: int) -> None:
        """Version 0 with eval.before_train; then the first published version at or past each multiple of
        eval.every_steps (with weightsync.every_steps > 1 not every multiple is published)."""
        due, self._next_eval = eval_due(version, self._next_eval, self.cfg.eval.every_steps,
                                        self.cfg.eval.before_train)
        if self.evals is not None and due:
            self.evals.open(version, self.cfg.eval.n, self.cfg.eval.temperature,
                            self.cfg.eval.max_tokens or self.cfg.rollout.max_tokens)

    def log_finished_evals(self) -> int:
        """Log each evaluation round that finished since the last call at its own step, with eval/lag_steps (the
        versions trained since it was asked for); returns how many are still open."""
        if self.evals is None:
            return 0
        for finished in self.evals.finished():
            metrics = eval_metrics(finished.results, list(self.cfg.eval.k_values), self.cfg.eval.pass_threshold)
            metrics["eval/lag_steps"] = float(self.version - finished.version)
            self.metrics_log.log(metrics, step=finished.version)
            self.eval_history.append({"step": finished.version, **metrics})
            log.info("learner: evaluation of v%d: mean reward %.4f over %d prompts (landed %d steps later)",
                     finished.version, metrics["eval/all/mean_reward"], int(metrics["eval/all/prompts"]),
                     self.version - finished.version)
        return len(self.evals.open_versions())

    def finish_evals(self) -> None:
        """At the end of the job: wait (at most eval.timeout_s, and only while some generator is alive) for the
        rounds still open, so the last evaluation is logged too."""
        deadline = time.monotonic() + self.cfg.eval.timeout_s
        while self.log_finished_evals() and time.monotonic() < deadline and self.buffer.live_generators():
            time.sleep(0.2)
        if self.evals is not None and self.evals.open_versions():
            log.warning("learner: evaluations of %s did not finish within eval.timeout_s", self.evals.open_versions())

    def data_done(self) -> bool:
        """Every prompt of the last epoch (data.epochs) was taken: the job ends with the batch in hand."""
        return self.dealer is not None and self.dealer.exhausted()

    def start(self) -> None:
        try:
            self.buffer.start()
        except DealError as err:  # the Redis cursor belongs to other data
            raise CheckpointError(str(err)) from None
        self._step_ended = time.monotonic()
        log.info("learner: buffer at %s, MLflow run %s in %s", self.buffer.endpoint, self.run_id, self.tracking_uri)

    def publish(self, weights, version: int, specs: list, extra: dict | None = None, full_bytes: int = 0,
                moved: bool = True) -> None:
        """Publish `version` and announce it; only then may generators be admitted against it. `full_bytes`: what
        a full version weighs, for the share a LoRA version's adapter sends. `moved`: the step had a gradient
        (a batch whose advantages are all 0 has none, and may rightly repeat the previous version's bytes)."""
        message = self.publisher.publish(weights, version, specs, extra=extra)
        self._check_changed(message, moved)
        catchup = self.publisher.catchup
        served = {"weightsync/catchup_served": float(catchup.served), "weightsync/catchup_deltas": float(
            catchup.deltas_served), "weightsync/catchup_deltas_prepared": float(catchup.deltas_prepared),
            "weightsync/catchup_prepared_used": float(catchup.prepared_used),
            "weightsync/catchup_bytes_frac": catchup.sent_bytes / catchup.full_bytes} \
            if catchup is not None and catchup.full_bytes else {}  # sent over what full copies would have sent
        self.publish_metrics = {**served, "weightsync/publish_bytes": float(message.nbytes),
                                "weightsync/publish_bytes_frac": message.nbytes / max(full_bytes, 1),
                                "weightsync/unchanged_versions": float(self.unchanged_versions)}
        self.buffer.announce_weights(message)
        self.buffer.set_version(version)
        self.version = version
        self._open_eval_if_due(version)

    def _check_changed(self, message, moved: bool = True) -> None:
        """Counts and logs a version that repeats the previous one's bytes after a trained step (publish.py's
        repeats_previous says why that matters); the critic's warmup steps leave the policy as it was, so there
        it is expected."""
        repeated, self._last_published = repeats_previous(self._last_published, message)
        warmup = self.cfg.algo.needs_critic() and message.version <= self.cfg.critic.warmup_steps
        if repeated and not warmup and moved:
            self.unchanged_versions += 1
            log.error("weight sync: v%d sends exactly the bytes of the version before it (%d bytes%s) although a step "
                      "was trained: the generators will sample the old policy (learning rate 0? an adapter that "
                      "does not train?)", message.version, message.nbytes,
                      ", the LoRA adapter" if message.lora is not None else "")

    def after_step(self, state: LearnerState, groups: list, collected, metrics: dict) -> None:
        """The step's audit trail, metrics, progress line, and the data cursor the next checkpoint keeps."""
        self.record_groups(state.version, groups)
        if self.dealer is not None:
            state.data_cursor = self.dealer.snapshot()  # between steps: every prompt taken so far is trained
            metrics["data/overlong_filtered"] = float(self.overlong_prompts)
        if self.evals is not None:
            self.log_finished_evals()
            metrics["eval/rounds_abandoned"] = float(self.evals.abandoned)
        buffer_metrics = self.buffer.metrics()
        metrics.update(buffer_metrics)
        prefix = "buffer/rejected/"
        self.rejected = {key[len(prefix):]: int(value) for key, value in buffer_metrics.items()
                         if key.startswith(prefix)}
        metrics.update(self.publish_metrics)
        self.publish_metrics = {}
        metrics["timing/learner/wait_for_batch_s"] = collected.wait_s
        now = time.monotonic()  # the wait's share of the whole step: collect, train, publish, log
        metrics["timing/learner/idle_frac"] = share(collected.wait_s, now - self._step_ended)
        self._step_ended = now
        metrics["buffer/staleness/mean"] = sum(collected.staleness) / len(collected.staleness)
        metrics["buffer/staleness/max"] = float(max(collected.staleness))
        for reason in DROP_REASONS:
            metrics[f"buffer/dropped/{reason}"] = float(collected.dropped[reason])  # this step
            metrics[f"buffer/dropped_total/{reason}"] = float(state.dropped_total[reason])  # since the job started
        metrics["buffer/dropped_stale"] = float(collected.dropped["stale"])
        metrics["buffer/consumed_total"] = float(state.groups_consumed)
        metrics["learner/skipped_steps"] = float(state.skipped_steps)
        metrics.update(component_means(groups, [f.name for f in self.cfg.reward.functions]))
        self.rewards.append(metrics["reward/mean"])
        self.metrics_log.log(metrics, step=state.version)
        self.progress.update(state.version, metrics)
        if self.plots is not None:
            self.plots.after_step()

    def record_groups(self, step: int, groups: list) -> None:
        """job_dir/trained_groups.jsonl: which groups, of which prompts, each step trained on (an audit trail:
        with the Redis backend every admitted group appears exactly once across restarts; with dealt prompts,
        every prompt once per epoch, counting for each step the learner's last life that trained it), and each
        sample's completion length, the distribution `asyncrl plan` simulates."""
        record = {"step": step, "groups": [group.group_id for group in groups],
                  "prompts": [group.prompt_id for group in groups],
                  "lengths": [[len(sample.completion_ids) for sample in group.samples] for group in groups]}
        with open(self.groups_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def close(self, status: str) -> None:
        """The end-of-job handshake (buffer/done.py) when the job finished, then everything is released."""
        try:
            if status == "FINISHED":
                untold = self.buffer.finish(self.cfg.buffer.done_grace_s)
                if untold:
                    log.warning("learner: generators %s did not poll within %.0f s of the end; they will time out",
                                untold, self.cfg.buffer.done_grace_s)
        finally:
            self.buffer.close()
            self.publisher.close()
            self.progress.close()
            stop_system_metrics(self.system_metrics)
            self.metrics_log.close()  # flushed, so the final plots read every point
            if self.plots is not None:
                self.plots.refresh()
            self.metrics_log.end_run(status)

    def summary(self, state: LearnerState, start_version: int) -> dict:
        """job_dir/summary.json: the reward at the start and the end, what was rejected (as of the last step) and
        dropped, who joined (held in memory: read after the buffer has closed)."""
        rewards = self.rewards
        window = max(1, len(rewards) // 10)
        summary = {
            "steps": len(rewards),
            "start_version": start_version,
            "reward_first": sum(rewards[:window]) / window if rewards else None,
            "reward_last": sum(rewards[-window:]) / window if rewards else None,
            "reward_window_steps": window,
            "rejected": dict(self.rejected),
            "dropped": dict(state.dropped_total),
            "generators": self.buffer.generators(),
            "eval": self.eval_history,
            "mlflow_tracking_uri": self.tracking_uri,
            "mlflow_run_id": self.run_id,
            "mlflow_experiment_id": self.experiment_id,
        }
        with open(os.path.join(self.job_dir, "summary.json"), "w") as handle:
            json.dump(summary, handle, indent=2)
        return summary


def model_files_for(model_path: str):
    """(archive, digest) of the model's config and tokenizer for generators with nothing shared, or None (logged)
    when the directory cannot be packed: generators then need the model at the same path."""
    try:
        return pack(model_path)
    except (ModelFilesError, OSError) as err:
        log.warning("learner: generators on other hosts cannot get the model files (%s); they need %s themselves",
                    err, model_path)
        return None
