"""The `asyncrl sft` job on this rank: build the policy (FSDP2, Ulysses) and the examples, run SFT on the learner's
own stack (learner/sft.py), save the full model. Parse, build, run, save; the CLI (launch/cli.py) only resolves
where the model and data are and joins the ranks.

What makes it a job one can run for real: epochs over the data (`sft.epochs`; each example once per epoch in a
seeded order) or `sft.steps` sampled batches; a learning-rate schedule (`sft.warmup_steps`, `sft.lr_schedule`,
`sft.min_lr_ratio`, learner/lr_schedule.py); a validation loss every `sft.val_every` steps and at the end, on
`sft.val_files` or a seeded `sft.val_fraction` of the data; checkpoints every `sft.checkpoint_every` steps
(learner/checkpoint.py: model, optimizer, schedule, RNG, and the step, from which the data position follows) with
`asyncrl sft --resume`; and MLflow logging in the RL runs' layout (params, resolved config, `sft/*` and
`policy/lr` per step, under the job's run).
"""
import functools
import logging
import os
import time
from dataclasses import dataclass

import torch

from asyncrl.configs import flatten, to_yaml
from asyncrl.configs.sections import part_seed
from asyncrl.learner.build import build_policy, checkpoint_root
from asyncrl.learner.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, read_state,
                                        resolve_checkpoint, save_checkpoint)
from asyncrl.learner.lr_schedule import lr_multiplier, resync_after_load
from asyncrl.learner.model import load_tokenizer
from asyncrl.learner.parallel import ParallelState
from asyncrl.learner.precision import resolve_autocast
from asyncrl.learner.publish import iter_full_weights
from asyncrl.learner.sft import batch_for_step, sft_eval_loss, sft_step
from asyncrl.data.sft import SFTDataError, read_sft_examples
from asyncrl.data.split import SplitError, split_held_out
from asyncrl.learner.state import LearnerState
from asyncrl.learner.train_step import StepSettings

log = logging.getLogger(__name__)
SAVE_BUCKET_BYTES = 256 << 20
"""The full weights are gathered from the FSDP shards this many bytes at a time when the model is saved."""


@dataclass
class SFTResult:
    losses: list
    """The loss of every step this run took (a resumed run: from its start step)."""
    out_dir: str
    """The saved HF model directory."""
    val_losses: list
    """(step, validation loss) pairs."""
    start_step: int = 0
    """The step it resumed at (0 for a fresh job)."""


def split_validation(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, validation): a seeded `fraction` of the examples held out (data/split.py, at least one when
    fraction > 0)."""
    try:
        return split_held_out(examples, fraction, seed, salt="sft-val")
    except SplitError as err:
        raise SFTDataError(f"sft.val_fraction={fraction}: {err}") from None


def total_steps(cfg_sft, examples: int) -> int:
    """sft.epochs × batches per epoch, or sft.steps without epochs."""
    if cfg_sft.epochs > 0:
        return cfg_sft.epochs * -(-examples // cfg_sft.batch_size)
    return cfg_sft.steps


def resume_point(learner, job_dir: str) -> str | None:
    """The SFT checkpoint to start from, per learner.resume (auto, never, or a path) of the learner section, as the
    RL learner's."""
    if learner.resume == "never":
        return None
    if learner.resume == "auto":
        return latest_checkpoint(checkpoint_root(learner.checkpoint_dir, job_dir))
    return resolve_checkpoint(learner.resume)


def run_sft_job(cfg, model_path: str, files: list, job_dir: str, parallel: ParallelState, say) -> SFTResult:
    """SFT of `model_path` on `files` (chat parquet with `messages`, or verl rows); the model and tokenizer are saved
    to <job_dir>/model by rank 0. Raises SFTDataError / FileNotFoundError for unusable data, CheckpointError for a
    checkpoint that does not fit."""
    sft = cfg.sft
    seed = part_seed(sft.seed, cfg.job.seed)
    torch.manual_seed(seed)
    if sft.torch_threads:
        torch.set_num_threads(sft.torch_threads)
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.learner.lora.enabled:
        say("sft: learner.lora is for RL; SFT trains every weight and saves a full model")
    model = build_policy(cfg.learner, cfg.model.trust_remote_code, model_path, parallel, adapters=False)
    examples = read_sft_examples(files, tokenizer, sft.max_length or None, sft.truncation)
    if sft.val_files:
        val = read_sft_examples(sft.val_files, tokenizer, sft.max_length or None, sft.truncation)
    else:
        examples, val = split_validation(examples, sft.val_fraction, seed)
    if not examples:
        raise SFTDataError("no SFT examples to train on")
    steps = total_steps(sft, len(examples))
    settings = StepSettings(version=0, max_staleness=0, max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch,
                            chunk_tokens=cfg.learner.logprob_chunk_tokens, grad_clip=cfg.learner.grad_clip,
                            packing=cfg.learner.packing, fp32_head=cfg.model.lm_head_fp32,
                            autocast=resolve_autocast(cfg.learner.autocast, parallel.device), parallel=parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_multiplier, warmup_steps=sft.warmup_steps, total_steps=max(steps, 1), schedule=sft.lr_schedule,
        min_ratio=sft.min_lr_ratio))
    start = 0
    found = resume_point(cfg.learner, job_dir)
    if found is not None:
        start = read_state(found).version
        if start > steps:
            raise CheckpointError(f"checkpoint {found} is at step {start}, past this job's {steps} steps: raise "
                                  f"sft.epochs / sft.steps to train on, or set learner.resume=never")
        load_checkpoint(found, model, optimizer, scheduler)
        resync_after_load(scheduler)
        say(f"sft: resumed from {found} at step {start}/{steps}")
    logger = _mlflow(cfg, parallel, job_dir)
    model.train()
    losses, val_losses = [], []
    root = checkpoint_root(cfg.learner.checkpoint_dir, job_dir)
    started = time.monotonic()
    for step in range(start, steps):
        _, indexes = batch_for_step(step, len(examples), sft.batch_size, seed, sft.epochs)
        loss = sft_step(model, optimizer, [examples[i] for i in indexes], settings)
        lr = optimizer.param_groups[0]["lr"]  # the rate this step used
        scheduler.step()
        losses.append(loss)
        done = step + 1
        metrics = {"sft/loss": loss, "policy/lr": lr, "sft/epoch": done * sft.batch_size / len(examples)
                   if sft.epochs <= 0 else done / -(-len(examples) // sft.batch_size),
                   "sft/examples": float(len(indexes)), "timing/sft/elapsed_s": time.monotonic() - started}
        if val and (done == steps or (sft.val_every and done % sft.val_every == 0)):
            metrics["sft/val_loss"] = sft_eval_loss(model, val, settings, sft.batch_size)
            val_losses.append((done, metrics["sft/val_loss"]))
        if logger is not None:
            logger.log(metrics, step=done)
        if done % 10 == 0 or done == steps or "sft/val_loss" in metrics:
            say(f"sft step {done}/{steps} loss {loss:.4f}"
                + (f" val {metrics['sft/val_loss']:.4f}" if "sft/val_loss" in metrics else ""))
        if sft.checkpoint_every and (done % sft.checkpoint_every == 0 or done == steps):
            save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=done),
                            cfg.learner.checkpoint_keep, model_dir=model_path)
    out_dir = os.path.expanduser(sft.save_dir) if sft.save_dir else os.path.join(job_dir, "model")
    weights = dict(iter_full_weights(model, parallel, torch.float32, SAVE_BUCKET_BYTES))  # every rank gathers
    if parallel.is_main:
        model.save_pretrained(out_dir, state_dict=weights)
        tokenizer.save_pretrained(out_dir)
    if logger is not None:
        logger.close("FINISHED")
        logger.trackers.close("FINISHED")
    return SFTResult(losses, out_dir, val_losses, start)


def _mlflow(cfg, parallel: ParallelState, job_dir: str):
    """The job's MLflow run on rank 0 (as an RL learner's: params, resolved config), with telemetry.loggers' other
    trackers beside it, or None; telemetry never stops training (a tracker whose package is missing stops the job
    before it starts: the recipe asked for it)."""
    if not parallel.is_main:
        return None
    from asyncrl.telemetry.mlflow_logger import MetricsLogger, create_or_attach_run, resolve_tracking_uri
    from asyncrl.telemetry.trackers import open_job_trackers

    trackers = open_job_trackers(cfg.telemetry, job_dir, cfg.job.name)
    config_yaml = to_yaml(cfg)
    trackers.log_params(flatten(cfg), config_yaml)
    try:
        uri = resolve_tracking_uri(cfg.telemetry.tracking_uri)
        logger = MetricsLogger(uri, create_or_attach_run(uri, cfg.telemetry.experiment, cfg.job.name),
                               trackers=trackers)
        logger.log_params(flatten(cfg))
        logger.log_text(config_yaml, "config/resolved.yaml")
        return logger
    except Exception as err:
        log.warning("sft: MLflow unavailable (%s); the loss goes to the log only", err)
        trackers.close("FAILED")
        return None
