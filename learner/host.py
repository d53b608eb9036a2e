"""What only rank 0 of the learner runs, composed: the job's record (telemetry/run_record.py), the weight publisher
and its announcements (learner/publish.py), the dealt prompts (learner/dealing.py), the evaluation rounds
(learner/evals.py) and the buffer (the zmq server's thread, or the Redis client). `LearnerHost` builds them in
that order, calls them in the step's order, and closes them; it holds no feature logic of its own.

The record is built first and closed last, and a part that fails to build closes every part built before it: a
buffer that cannot bind its port leaves no MLflow run RUNNING, no shm ring and no catch-up thread behind.
"""
import logging
import os
import socket
from contextlib import ExitStack

from asyncrl.buffer.backends import job_limits, make_learner_buffer
from asyncrl.buffer.dealing import DealError
from asyncrl.buffer.interface import RunInfo
from asyncrl.configs import flatten, shared_hash, shared_sections, to_yaml
from asyncrl.data.prompts import PromptSet
from asyncrl.data.vision import is_vision, placeholder_tokens
from asyncrl.learner.build import refuse_vision_job
from asyncrl.learner.checkpoint import CheckpointError
from asyncrl.learner.dealing import build_dealer
from asyncrl.learner.evals import Evaluations, build_eval_rounds
from asyncrl.learner.learnable import LearnableWatch
from asyncrl.learner.model import load_tokenizer, model_positions
from asyncrl.learner.objective import resolved_hyperparameters
from asyncrl.learner.parallel import ParallelState
from asyncrl.learner.publish import VersionPublisher, model_files_for
from asyncrl.learner.state import LearnerState
from asyncrl.learner.step_metrics import component_means
from asyncrl.learner.trust import GeneratorTrust
from asyncrl.moe.routing import routing_shape
from asyncrl.security.curve import server_keys
from asyncrl.telemetry.run_record import RunRecord, batch_metrics
from asyncrl.weightsync.backends import make_publisher

log = logging.getLogger(__name__)


def build_run_info(job_name: str, model_path: str, train_files: list, job_dir: str, record: RunRecord,
                   model_files: tuple | None, lora, dealer, deal_timeout_s: float, evaluates: bool,
                   routing_replay: bool = False) -> RunInfo:
    """What the learner tells every generator in its hello reply: where the model and the run are, and which
    features of this job the generator must take part in."""
    return RunInfo(
        model_path=os.path.abspath(model_path), train_files=tuple(os.path.abspath(f) for f in train_files),
        mlflow_run_id=record.run_id, tracking_uri=record.tracking_uri, host=socket.gethostname(),
        job_dir=os.path.abspath(job_dir), job=job_name,
        model_files=model_files[1] if model_files is not None else "",  # what a generator on another host starts from
        lora_rank=lora.rank if lora.enabled else 0,  # the generators' vLLM engines size their adapter slots by it
        deals=dealer is not None,  # generators sample what they are dealt and need no copy of the data
        data_sources=tuple(dealer.data_sources) if dealer is not None else (), deal_timeout_s=deal_timeout_s,
        evals=evaluates,  # a Redis generator asks for evaluation prompts only then
        routing_replay=routing_replay)  # the generators' engines record every token's experts


def table_decoder(model_path: str, trust_remote_code: bool):
    """token ids -> text for the run's samples tables (the model's tokenizer), or None when no tokenizer loads from
    the model directory (warned; training needs none, and the job goes on without the tables)."""
    try:
        tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - the tables are for reading; the job goes on without them
        log.warning("learner: no tokenizer loads from %s (%s), so the run has no samples tables", model_path, err)
        return None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def unreachable_weight_servers(buffer_cfg, weightsync_cfg) -> str | None:
    """Why generators that reach the buffer beyond this machine could not reach the weight catch-up server, or None
    (`buffer_cfg`, `weightsync_cfg`: those config sections). The zmq buffer listening on buffer.host beyond loopback says generators come from elsewhere (other machines or
    network namespaces), and every one of them that falls behind the shared-memory ring, or runs on another machine,
    loads its weights from the catch-up server: bound to loopback and advertised as such, it answers none of them,
    and each load waits out weightsync.timeout_s before the generator goes on with stale weights."""
    if buffer_cfg.backend != "zmq" or buffer_cfg.host in LOOPBACK_HOSTS:
        return None
    if weightsync_cfg.host not in LOOPBACK_HOSTS or weightsync_cfg.advertise:
        return None
    return (f"the buffer listens on {buffer_cfg.host} but the weight catch-up server on {weightsync_cfg.host}: "
            f"generators reaching the buffer from another machine or network namespace cannot load weights from it; "
            f"set weightsync.host={buffer_cfg.host} (or 0.0.0.0 with weightsync.advertise=<this host>)")


class LearnerHost:
    def __init__(self, cfg, model, model_path: str, train_files: list, job_dir: str, parallel: ParallelState,
                 state: LearnerState, resumed_from: str | None, prompts: PromptSet | None = None,
                 eval_prompts: PromptSet | None = None):
        with ExitStack() as built:  # on any failure below, what was built is closed, newest first
            self.record = RunRecord(cfg.telemetry, cfg.job.name, job_dir, cfg.learner.total_steps,
                                    decode=table_decoder(model_path, cfg.model.trust_remote_code),
                                    resume_run_id=state.mlflow_run_id if resumed_from is not None else "")
            state.mlflow_run_id = self.record.run_id  # saved with every checkpoint
            built.callback(self.record.close, "FAILED")
            self.record.write_config({**flatten(cfg), **resolved_hyperparameters(cfg.algo),
                                      "learner.world_size": parallel.world_size, "learner.dp_size": parallel.dp_size},
                                     to_yaml(cfg))
            unreachable = unreachable_weight_servers(cfg.buffer, cfg.weightsync)
            if unreachable:
                log.warning("learner: %s", unreachable)
            publisher = make_publisher(cfg.weightsync, cfg.job.name, keys=server_keys(cfg.security.keys_dir))
            built.callback(publisher.close)
            files = model_files_for(model_path)
            if files is not None:
                publisher.catchup.serve_files(*files)
            self.dealer, self.overlong_prompts = build_dealer(prompts, cfg.data, cfg.job.seed, state.data_cursor)
            if is_vision(model.config):
                refuse_vision_job(cfg, deals=self.dealer is not None)
            self.images = {row.prompt_id: row.images for row in prompts.rows if row.images} if prompts else {}
            """A multimodal prompt's images by its id: what each of its groups trains with (learner/loop.py)."""
            rounds = build_eval_rounds(eval_prompts, cfg.eval.every_steps, cfg.eval.timeout_s)
            run_info = build_run_info(cfg.job.name, model_path, train_files, job_dir, self.record, files,
                                      cfg.learner.lora, self.dealer, cfg.data.deal_timeout_s, rounds is not None,
                                      cfg.learner.moe_routing_replay)
            limits = job_limits(cfg.rollout, cfg.data.max_prompt_tokens, model_positions(model),
                                episodes=cfg.samples_episodes(),
                                routing=routing_shape(model.config) if cfg.learner.moe_routing_replay else None,
                                forbidden_tokens=placeholder_tokens(model.config) if is_vision(model.config) else ())
            self.buffer = make_learner_buffer(cfg.buffer, cfg.security, cfg.job.name, limits,
                                              vocab_size=model.get_input_embeddings().num_embeddings,
                                              config_hash=shared_hash(cfg),
                                              shared_config=shared_sections(cfg), run_info=run_info,
                                              start_version=state.version, fresh=resumed_from is None,
                                              dealer=self.dealer, evals=rounds)
            if self.dealer is not None:  # with Redis the cursor lives there (buffer/redis/dealing.py)
                self.dealer = self.buffer.dealer
            warmup = cfg.critic.warmup_steps if cfg.algo.needs_critic() else -1  # the policy stays as it was
            self.publishing = VersionPublisher(publisher, self.buffer, state.version, unchanged_until=warmup)
            self.evals = Evaluations(rounds, cfg.eval, cfg.eval.max_tokens or cfg.rollout.max_tokens, state.version,
                                     self.record, source=eval_prompts.source if eval_prompts is not None else "")
            built.pop_all()  # built: close() owns them now
        self.learnable = LearnableWatch(self.buffer.sampled_so_far, cfg.algo.unlearnable_after_groups,
                                        cfg.algo.dynamic_sampling)
        """Stops (or warns about) a job whose first groups all score alike (learner/learnable.py)."""
        self.trust = GeneratorTrust(cfg.learner.quarantine_abs_diff, cfg.learner.quarantine_window_groups,
                                    quarantined=state.quarantined)
        """Each generator's logprob mismatch, and those quarantined for it (learner/trust.py), the checkpoint's
        included."""
        for why in self.trust.quarantined.values():
            log.warning("learner: still quarantined from before the restart: %s", why)
        self.reward_names = [function.name for function in cfg.reward.functions]
        self.done_grace_s = cfg.buffer.done_grace_s
        if resumed_from is not None:
            log.info("learner: resumed from %s at version %d", resumed_from, state.version)

    def data_done(self) -> bool:
        """Every prompt of the last epoch (data.epochs) was taken: the job ends with the batch in hand."""
        return self.dealer is not None and self.dealer.exhausted()

    def start(self) -> None:
        try:
            self.buffer.start()
        except DealError as err:  # the Redis cursor belongs to other data
            raise CheckpointError(str(err)) from None
        self.record.start_clock()
        log.info("learner: buffer at %s, MLflow run %s in %s", self.buffer.endpoint, self.record.run_id,
                 self.record.tracking_uri)

    def publish(self, weights, version: int, specs: list, extra: dict | None = None, full_bytes: int = 0,
                moved: bool = True) -> None:
        """Publish and announce `version` (learner/publish.py), then open its evaluation round when one is due."""
        self.publishing.publish(weights, version, specs, extra=extra, full_bytes=full_bytes, moved=moved)
        self.evals.open_if_due(version)

    def after_step(self, state: LearnerState, groups: list, collected, metrics: dict) -> None:
        """The data cursor the next checkpoint keeps, then the step's metrics and record."""
        state.quarantined = dict(self.trust.quarantined)
        if self.dealer is not None:
            state.data_cursor = self.dealer.snapshot()  # between steps: every prompt taken so far is trained
            metrics["data/overlong_filtered"] = float(self.overlong_prompts)
        metrics.update(self.evals.after_step(self.publishing.version))
        metrics.update(self.buffer.metrics())
        metrics.update(self.publishing.take_metrics())
        metrics.update(batch_metrics(collected.staleness, collected.dropped, state.dropped_total))
        metrics["buffer/consumed_total"] = float(state.groups_consumed)
        metrics["learner/skipped_steps"] = float(state.skipped_steps)
        metrics["learner/checkpoint_failures"] = float(state.checkpoint_failures)
        metrics.update(self.trust.metrics())
        metrics.update(component_means(groups, self.reward_names))
        metrics.update(self.buffer.take_sampled())  # every group sampled since the last step, not only these
        self.learnable.check(may_stop=False)  # such groups trained (no dynamic sampling): it can only warn
        self.record.log_step(state.version, groups, metrics, collected.wait_s, collected.staleness)

    def finish_evals(self) -> None:
        self.evals.finish(self.publishing.version, self.buffer.live_generators, self.buffer.serve_evals)

    def close(self, status: str, tell_generators: bool = False) -> None:
        """The end-of-job handshake (buffer/done.py) when the job finished or the learner chose to stop
        (`tell_generators`: learner/learnable.py), then everything is released (each part even when an earlier one
        fails to close; the run ends last, with `status`)."""
        with ExitStack() as closing:
            closing.callback(self.record.close, status)
            closing.callback(self.publishing.close)
            closing.callback(self.buffer.close)
            if tell_generators:
                untold = self.buffer.finish(self.done_grace_s)
                if untold:
                    log.warning("learner: generators %s did not poll within %.0f s of the end; they will time out",
                                untold, self.done_grace_s)

    def summary(self, state: LearnerState, start_version: int) -> dict:
        """job_dir/summary.json (telemetry/run_record.py); who joined is held in memory, read after the buffer
        closed."""
        return self.record.summary(start_version, state.dropped_total, self.buffer.generators())
