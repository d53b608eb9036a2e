"""The learner process: take a batch, train one step, publish the new version, log. Repeat.

It hosts the embedded buffer (a background thread) and the weight publisher. It waits on: full batches (bounded by
`learner.wait_for_batch_timeout_s`). It unblocks generators by publishing each version, which raises admission.
"""
import json
import logging
from collections import Counter
import os
import time

import torch

from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq_server import ZmqBufferServer
from asyncrl.configs import flatten, shared_hash, to_yaml
from asyncrl.algos.kl import AdaptiveKLController, FixedKLController
from asyncrl.learner.collect import BatchFilter, collect_batch
from asyncrl.learner.model import load_model
from asyncrl.learner.objective import resolved_hyperparameters
from asyncrl.learner.train_step import StepSettings, train_step
from asyncrl.telemetry.mlflow_logger import MetricsLogger, create_or_attach_run, resolve_tracking_uri
from asyncrl.telemetry.progress import ProgressDisplay
from asyncrl.weightsync.shm import ShmWeightPublisher

log = logging.getLogger(__name__)


def build_optimizer(model, cfg):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    warmup = max(cfg.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
    return optimizer, scheduler


def run_learner(cfg, model_path: str, train_files: list, job_dir: str) -> dict:
    """Runs the whole job's training; returns the summary (also written to job_dir/summary.json)."""
    torch.manual_seed(cfg.learner.seed)
    if cfg.learner.torch_threads:
        torch.set_num_threads(cfg.learner.torch_threads)
    model = load_model(model_path, cfg.learner.dtype, cfg.model.trust_remote_code).train()
    optimizer, scheduler = build_optimizer(model, cfg.learner)
    algo_state = build_algo_state(cfg, model_path)
    tracking_uri = resolve_tracking_uri(cfg.telemetry.tracking_uri)
    run_id = create_or_attach_run(tracking_uri, cfg.telemetry.experiment, cfg.job.name)
    metrics_log = MetricsLogger(tracking_uri, run_id)
    metrics_log.log_params({**flatten(cfg), **resolved_hyperparameters(cfg.algo)})
    metrics_log.log_text(to_yaml(cfg), "config/resolved.yaml")
    publisher = ShmWeightPublisher(os.path.join(cfg.weightsync.shm_dir, f"asyncrl-{cfg.job.name}-{os.getpid()}"),
                                   cfg.weightsync.keep_versions, cfg.weightsync.dtype)
    coordinator = Coordinator(cfg.buffer.max_staleness, cfg.buffer.groups_per_step)
    run_info = {"model_path": os.path.abspath(model_path), "train_files": [os.path.abspath(f) for f in train_files],
                "mlflow_run_id": run_id, "tracking_uri": tracking_uri, "job_dir": os.path.abspath(job_dir)}
    server = ZmqBufferServer(
        cfg.buffer.host, cfg.buffer.port, coordinator, vocab_size=model.get_input_embeddings().num_embeddings,
        config_hash=shared_hash(cfg), max_message_bytes=cfg.buffer.max_message_bytes,
        queue_groups=cfg.buffer.queue_groups, run_info=run_info)
    progress = ProgressDisplay(cfg.learner.total_steps, os.path.join(job_dir, "progress.jsonl"),
                               enabled=cfg.telemetry.progress)
    rewards, status = [], "FAILED"
    try:
        server.set_weights(publisher.publish(model.state_dict().items(), 0))
        server.start()
        log.info("learner: buffer at %s, MLflow run %s in %s", server.endpoint, run_id, tracking_uri)
        for version in range(cfg.learner.total_steps):
            metrics = run_one_step(cfg, model, optimizer, scheduler, server, coordinator, publisher, version,
                                   algo_state)
            rewards.append(metrics["reward/mean"])
            metrics_log.log(metrics, step=version + 1)
            progress.update(version + 1, metrics)
        status = "FINISHED"
    finally:
        server.set_done()
        if status == "FINISHED":  # let every generator hear "done" (a late joiner may still be loading)
            unheard = server.wait_for_generators_to_hear_done(cfg.learner.done_grace_s)
            if unheard:
                log.warning("learner: generators %s did not poll within %.0f s of the end; they will time out",
                            unheard, cfg.learner.done_grace_s)
        server.close()
        publisher.close()
        progress.close()
        metrics_log.close(status=status)
    return write_summary(job_dir, rewards, tracking_uri, run_id, server, algo_state["dropped_total"])


def build_algo_state(cfg, model_path: str) -> dict:
    """The frozen reference model (only when a KL coefficient is non-zero), the reward-KL controller and the
    batch filter. Loading the reference costs a second copy of the weights, so nothing loads it by default."""
    algo = cfg.algo
    ref_model = None
    if algo.needs_reference_model():
        ref_model = load_model(model_path, cfg.learner.dtype, cfg.model.trust_remote_code).eval()
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


def run_one_step(cfg, model, optimizer, scheduler, server, coordinator, publisher, version: int,
                 algo_state: dict) -> dict:
    collected = collect_batch(server, coordinator, cfg.buffer.groups_per_step, cfg.buffer.max_staleness, version,
                              cfg.learner.wait_for_batch_timeout_s, algo_state["batch_filter"])
    settings = StepSettings(version=version, max_staleness=cfg.buffer.max_staleness,
                            max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch,
                            chunk_tokens=cfg.learner.logprob_chunk_tokens, grad_clip=cfg.learner.grad_clip,
                            seed=cfg.learner.seed, packing=cfg.learner.packing)
    metrics = train_step(model, optimizer, scheduler, collected.groups, cfg.algo, settings,
                         ref_model=algo_state["ref_model"], kl_controller=algo_state["kl_controller"])
    started = time.perf_counter()
    server.set_weights(publisher.publish(model.state_dict().items(), version + 1))
    coordinator.set_version(version + 1)  # only now may generators be admitted against v+1
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
    metrics["buffer/size"] = float(server.groups.qsize())
    metrics["buffer/received"] = float(server.received)
    for reason, count in server.rejected.items():
        metrics[f"buffer/rejected/{reason}"] = float(count)
    generator_rates = [s.get("perf/generator/tokens_per_s", 0.0) for s in server.generator_stats.values()]
    metrics["perf/generator/tokens_per_s"] = float(sum(generator_rates))
    return metrics


def write_summary(job_dir: str, rewards: list, tracking_uri: str, run_id: str, server, dropped: Counter) -> dict:
    window = max(1, len(rewards) // 10)
    summary = {
        "steps": len(rewards),
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
