"""The learner process: take a batch, train one step, publish the new version, log, checkpoint. Repeat.

On N ranks (torchrun), rank 0 hosts the embedded buffer (a background thread), MLflow and the weight publisher,
and sends each batch to every rank; all ranks train on it (FSDP2 × Ulysses) and gather the new weights for rank 0
to publish. It waits on: full batches (bounded by `learner.wait_for_batch_timeout_s`), and collectives (bounded by
`learner.dist_timeout_s`). It unblocks generators by publishing each version, which raises admission. A restarted
job resumes from its newest checkpoint (`learner.resume=auto`) at the same version.
"""
import json
import logging
from collections import Counter
import os
import time

import torch

from asyncrl.buffer.backends import make_learner_buffer
from asyncrl.configs import flatten, shared_hash, to_yaml
from asyncrl.algos.kl import AdaptiveKLController, FixedKLController
from asyncrl.learner.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, read_meta,
                                        resolve_checkpoint, save_checkpoint, wait_for_pending_save)
from asyncrl.learner.collect import BatchFilter, collect_batch
from asyncrl.learner.model import load_model
from asyncrl.learner.objective import resolved_hyperparameters
from asyncrl.learner.parallel import ParallelState, apply_fsdp, broadcast_object
from asyncrl.learner.publish import iter_full_weights, weight_specs
from asyncrl.learner.ulysses import apply_ulysses
from asyncrl.learner.train_step import StepSettings, train_step
from asyncrl.telemetry.mlflow_logger import MetricsLogger, create_or_attach_run, resolve_tracking_uri
from asyncrl.telemetry.progress import ProgressDisplay
from asyncrl.weightsync.backends import make_publisher

log = logging.getLogger(__name__)


def build_optimizer(model, cfg):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    warmup = max(cfg.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
    return optimizer, scheduler


def build_policy(cfg, model_path: str, parallel: ParallelState):
    """The HF model on this rank: loaded, routed through Ulysses when sp_size > 1, then FSDP2-sharded."""
    model = load_model(model_path, cfg.learner.dtype, cfg.model.trust_remote_code, cfg.learner.attn_implementation)
    model.to(parallel.device)
    if parallel.sp_size > 1:
        apply_ulysses(model, parallel.sp_group, parallel.sp_size)
    return apply_fsdp(model, parallel, param_dtype=cfg.learner.param_dtype or cfg.learner.dtype,
                      reduce_dtype=cfg.learner.reduce_dtype, cpu_offload=cfg.learner.cpu_offload,
                      activation_checkpointing=cfg.learner.activation_checkpointing)


def checkpoint_root(cfg, job_dir: str) -> str:
    """learner.checkpoint_dir, else the job directory's checkpoints/ (a fresh job directory never resumes by
    accident; a fixed checkpoint_dir, or ASYNCRL_JOB_DIR reused, makes restarts pick up where they stopped)."""
    return cfg.learner.checkpoint_dir or os.path.join(job_dir, "checkpoints")


def find_resume_point(cfg, job_dir: str) -> str | None:
    """The checkpoint to start from, per learner.resume ("auto", "never" or a path)."""
    if cfg.learner.resume == "never":
        return None
    if cfg.learner.resume == "auto":
        found = latest_checkpoint(checkpoint_root(cfg, job_dir))
    else:
        found = resolve_checkpoint(cfg.learner.resume)
    if found is not None:
        version = read_meta(found)["version"]
        if version >= cfg.learner.total_steps:
            raise CheckpointError(
                f"checkpoint {found} is at version {version} >= learner.total_steps={cfg.learner.total_steps}: that "
                f"job already finished. Raise learner.total_steps to train on, or set learner.resume=never (or "
                f"another learner.checkpoint_dir) to start over")
    return found


def run_learner(cfg, model_path: str, train_files: list, job_dir: str,
                parallel: ParallelState | None = None) -> dict | None:
    """Runs the whole job's training on this rank; returns the summary on rank 0 (also written to
    job_dir/summary.json), None on the others. Rank 0 hosts the buffer, MLflow and the weight publisher; every rank
    trains on every batch (each its share of the rows or of the sequence)."""
    parallel = parallel or ParallelState()
    torch.manual_seed(cfg.learner.seed)
    if cfg.learner.torch_threads:
        torch.set_num_threads(cfg.learner.torch_threads)
    model = build_policy(cfg, model_path, parallel).train()
    optimizer, scheduler = build_optimizer(model, cfg.learner)
    algo_state = build_algo_state(cfg, model_path, parallel)
    start_version, consumed = 0, {"groups": 0, "by_generator": {}}
    resume_from = find_resume_point(cfg, job_dir)
    if resume_from is not None:
        start_version, consumed = load_checkpoint(resume_from, model, optimizer, scheduler)
        algo_state["dropped_total"].update(consumed.get("dropped_total", {}))
        if parallel.is_main:
            log.info("learner: resumed from %s at version %d", resume_from, start_version)
    host = LearnerHost(cfg, model, model_path, train_files, job_dir, parallel, start_version,
                       fresh=resume_from is None) if parallel.is_main else None
    acks = AckLedger(host.server if host is not None else None, consumed)
    rewards, status = [], "FAILED"
    try:
        publish_weights(model, parallel, host, start_version, cfg)
        if host is not None:
            host.start()
        for version in range(start_version, cfg.learner.total_steps):
            metrics = run_one_step(cfg, model, optimizer, scheduler, host, parallel, version, algo_state, consumed)
            if host is not None:
                host.record_groups(version + 1, metrics.pop("_group_ids"))
                rewards.append(metrics["reward/mean"])
                host.metrics_log.log(metrics, step=version + 1)
                host.progress.update(version + 1, metrics)
            every = cfg.learner.checkpoint_every
            if every and ((version + 1) % every == 0 or version + 1 == cfg.learner.total_steps):
                consumed["dropped_total"] = dict(algo_state["dropped_total"])
                save_checkpoint(checkpoint_root(cfg, job_dir), model, optimizer, scheduler, version + 1, consumed,
                                cfg.learner.checkpoint_keep, model_dir=model_path,
                                async_save=cfg.learner.checkpoint_async)
                acks.checkpointed(background=cfg.learner.checkpoint_async)
            elif not every:
                acks.checkpointed(background=False)  # no checkpoints: nothing to resume from, ack at once
        wait_for_pending_save()
        acks.all_saved()
        status = "FINISHED"
    finally:
        if host is not None:
            host.close(status)
    if host is None:
        return None
    return write_summary(job_dir, rewards, host.tracking_uri, host.run_id, host.server, algo_state["dropped_total"],
                         start_version)


class LearnerHost:
    """What only rank 0 runs: the embedded buffer, the staleness coordinator, MLflow, the progress display and the
    weight publisher."""

    def __init__(self, cfg, model, model_path: str, train_files: list, job_dir: str, parallel: ParallelState,
                 start_version: int, fresh: bool):
        self.cfg = cfg
        self.tracking_uri = resolve_tracking_uri(cfg.telemetry.tracking_uri)
        self.run_id = create_or_attach_run(self.tracking_uri, cfg.telemetry.experiment, cfg.job.name)
        self.metrics_log = MetricsLogger(self.tracking_uri, self.run_id)
        self.metrics_log.log_params({**flatten(cfg), **resolved_hyperparameters(cfg.algo),
                                     "learner.world_size": parallel.world_size, "learner.dp_size": parallel.dp_size})
        self.metrics_log.log_text(to_yaml(cfg), "config/resolved.yaml")
        self.publisher = make_publisher(cfg.weightsync, cfg.job.name)
        run_info = {"model_path": os.path.abspath(model_path), "train_files": [os.path.abspath(f) for f in train_files],
                    "mlflow_run_id": self.run_id, "tracking_uri": self.tracking_uri,
                    "job_dir": os.path.abspath(job_dir), "job": cfg.job.name}
        self.server, self.coordinator = make_learner_buffer(
            cfg, vocab_size=model.get_input_embeddings().num_embeddings, config_hash=shared_hash(cfg),
            run_info=run_info, start_version=start_version, fresh=fresh)
        self.groups_path = os.path.join(job_dir, "trained_groups.jsonl")
        self.progress = ProgressDisplay(cfg.learner.total_steps, os.path.join(job_dir, "progress.jsonl"),
                                        enabled=cfg.telemetry.progress)

    def record_groups(self, step: int, group_ids: list) -> None:
        """job_dir/trained_groups.jsonl: which groups each step trained on (an audit trail: with the Redis
        backend every admitted group appears exactly once across restarts)."""
        with open(self.groups_path, "a") as handle:
            handle.write(json.dumps({"step": step, "groups": group_ids}) + "\n")

    def start(self) -> None:
        self.server.start()
        log.info("learner: buffer at %s, MLflow run %s in %s", self.server.endpoint, self.run_id, self.tracking_uri)

    def close(self, status: str) -> None:
        self.server.set_done()
        if status == "FINISHED":  # let every generator hear "done" (a late joiner may still be loading)
            unheard = self.server.wait_for_generators_to_hear_done(self.cfg.learner.done_grace_s)
            if unheard:
                log.warning("learner: generators %s did not poll within %.0f s of the end; they will time out",
                            unheard, self.cfg.learner.done_grace_s)
        self.server.close()
        self.publisher.close()
        self.progress.close()
        self.metrics_log.close(status=status)


class AckLedger:
    """When the Redis stream may forget a trained group: only once a checkpoint covering its step is on disk.

    `consumed["unacked"]` lists the entries trained since the last acknowledgement and is saved inside each
    checkpoint, so a learner killed between writing a checkpoint and acking acks those entries at restart instead
    of training them twice. A background save is acked when it is known to be complete (the next save, or the end).
    """

    def __init__(self, server, consumed: dict):
        self.server = server if hasattr(server, "ack") else None
        self.consumed = consumed
        self.awaiting: list = []
        if self.server is not None and consumed.get("unacked"):
            self.server.ack(consumed.pop("unacked"))  # covered by the checkpoint we resumed from
        consumed["unacked"] = []

    def checkpointed(self, background: bool) -> None:
        if self.server is None:
            return
        if self.awaiting:  # the previous background save finished before this one started
            self.server.ack(self.awaiting)
        covered, self.consumed["unacked"] = self.consumed["unacked"], []
        if background:
            self.awaiting = covered
        else:
            self.awaiting = []
            self.server.ack(covered)

    def all_saved(self) -> None:
        if self.server is not None and self.awaiting:
            self.server.ack(self.awaiting)
            self.awaiting = []


def publish_weights(model, parallel: ParallelState, host, version: int, cfg) -> None:
    """Gather the full weights bucket by bucket on every rank; rank 0 publishes `version` (the publisher casts to
    weightsync.dtype as it copies each tensor into its ring)."""
    bucket_bytes = int(cfg.learner.publish_bucket_mb * 2**20)
    weights = iter_full_weights(model, parallel, None, bucket_bytes)
    if host is None:
        for _ in weights:  # nothing is yielded here; iterating runs this rank's side of the gathers
            pass
        return
    host.server.set_weights(host.publisher.publish(weights, version, weight_specs(model, cfg.weightsync.dtype)))


def build_algo_state(cfg, model_path: str, parallel: ParallelState) -> dict:
    """The frozen reference model (only when a KL coefficient is non-zero), the reward-KL controller and the
    batch filter. Loading the reference costs a second copy of the weights, so nothing loads it by default."""
    algo = cfg.algo
    ref_model = None
    if algo.needs_reference_model():
        ref_model = build_policy(cfg, model_path, parallel).eval()
        ref_model.requires_grad_(False)
        log.info("learner: loaded the reference model for the KL term from %s", model_path)
    if algo.kl_controller == "adaptive":
        controller = AdaptiveKLController(algo.kl_reward_coef, algo.kl_target, algo.kl_horizon)
    else:
        controller = FixedKLController(algo.kl_reward_coef)
    batch_filter = BatchFilter(group_size=cfg.rollout.n, dynamic_sampling=algo.dynamic_sampling,
                               needs_baseline=algo.advantage == "remax")
    return {"ref_model": ref_model, "kl_controller": controller, "batch_filter": batch_filter,
            "dropped_total": Counter()}


class BatchUnavailable(RuntimeError):
    """Rank 0 could not assemble a batch; the other ranks stop with its message."""


def next_batch(cfg, host, parallel: ParallelState, version: int, algo_state: dict, consumed: dict):
    """Rank 0 collects the step's groups from the buffer and sends them to every rank; every rank gets
    (groups, Collected or None). A failure on rank 0 is sent too, so no rank waits in a collective forever."""
    collected, message = None, None
    if host is not None:
        try:
            collected = collect_batch(host.server, host.coordinator, cfg.buffer.groups_per_step,
                                      cfg.buffer.max_staleness, version, cfg.learner.wait_for_batch_timeout_s,
                                      algo_state["batch_filter"])
            message = ("groups", collected.groups)
        except Exception as err:
            message = ("error", f"{type(err).__name__}: {err}")
            broadcast_object(message, parallel)
            raise
    kind, payload = broadcast_object(message, parallel)
    if kind == "error":
        raise BatchUnavailable(f"rank 0 could not assemble batch v{version}: {payload}")
    consumed["groups"] = consumed.get("groups", 0) + len(payload)
    by_generator = consumed.setdefault("by_generator", {})
    for group in payload:
        by_generator[group.generator_id] = by_generator.get(group.generator_id, 0) + 1
    return payload, collected


def run_one_step(cfg, model, optimizer, scheduler, host, parallel: ParallelState, version: int, algo_state: dict,
                 consumed: dict) -> dict:
    groups, collected = next_batch(cfg, host, parallel, version, algo_state, consumed)
    settings = StepSettings(version=version, max_staleness=cfg.buffer.max_staleness,
                            max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch,
                            chunk_tokens=cfg.learner.logprob_chunk_tokens, grad_clip=cfg.learner.grad_clip,
                            seed=cfg.learner.seed, packing=cfg.learner.packing, parallel=parallel)
    metrics = train_step(model, optimizer, scheduler, groups, cfg.algo, settings,
                         ref_model=algo_state["ref_model"], kl_controller=algo_state["kl_controller"])
    started = time.perf_counter()
    publish_weights(model, parallel, host, version + 1, cfg)
    if host is None:
        return metrics
    metrics["_group_ids"] = [group.group_id for group in groups]
    server = host.server
    host.coordinator.set_version(version + 1)  # only now may generators be admitted against v+1
    metrics["timing/weightsync/publish_s"] = time.perf_counter() - started
    metrics["timing/learner/wait_for_batch_s"] = collected.wait_s
    metrics["buffer/staleness/mean"] = sum(collected.staleness) / len(collected.staleness)
    metrics["buffer/staleness/max"] = float(max(collected.staleness))
    dropped_total = algo_state["dropped_total"]
    dropped_total.update(collected.dropped)
    for reason in ("stale", "zero_variance", "group_size", "no_baseline", "empty"):
        metrics[f"buffer/dropped/{reason}"] = float(collected.dropped[reason])  # this step
        metrics[f"buffer/dropped_total/{reason}"] = float(dropped_total[reason])  # since the job started
    metrics["buffer/dropped_stale"] = float(collected.dropped_stale)
    metrics["buffer/size"] = float(server.queued())
    metrics["buffer/received"] = float(server.received)
    metrics["buffer/consumed_total"] = float(consumed["groups"])
    # copies first (one C call each, so atomic): the zmq server's threads add keys to both while the learner reads
    for reason, count in dict(server.rejected).items():
        metrics[f"buffer/rejected/{reason}"] = float(count)
    generator_rates = [s.get("perf/generator/tokens_per_s", 0.0) for s in list(server.generator_stats.values())]
    metrics["perf/generator/tokens_per_s"] = float(sum(generator_rates))
    if hasattr(server, "taken_entries"):  # Redis: these groups are acked once a checkpoint covers this step
        consumed.setdefault("unacked", []).extend(entry.decode() for entry in server.taken_entries)
        server.taken_entries.clear()
        metrics["buffer/dropped/future_version"] = float(server.dropped_future)
        metrics["buffer/redis/outages"] = float(getattr(server.retry, "outages", 0))  # lost and reconnected
        metrics["buffer/redis/redelivered"] = float(server.redelivered)  # re-read after a reconnect, skipped
        metrics["buffer/redis/duplicates"] = float(server.duplicates)  # resent deliveries dropped on arrival
    return metrics


def write_summary(job_dir: str, rewards: list, tracking_uri: str, run_id: str, server, dropped: Counter,
                  start_version: int = 0) -> dict:
    window = max(1, len(rewards) // 10)
    summary = {
        "steps": len(rewards),
        "start_version": start_version,
        "reward_first": sum(rewards[:window]) / window if rewards else None,
        "reward_last": sum(rewards[-window:]) / window if rewards else None,
        "reward_window_steps": window,
        "rejected": dict(server.rejected),
        "dropped": dict(dropped),
        "generators": server.joins,
        "mlflow_tracking_uri": tracking_uri,
        "mlflow_run_id": run_id,
    }
    with open(os.path.join(job_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    return summary
