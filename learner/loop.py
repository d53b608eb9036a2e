"""The learner process: take a batch, train one step, publish the new version, log, checkpoint. Repeat.

On N ranks (torchrun), rank 0 hosts the buffer (learner/host.py: the embedded zmq server's thread, or the Redis
client), MLflow and the weight publisher, and sends each batch to every rank; all ranks train on it (FSDP2 ×
Ulysses) and gather the new weights for rank 0 to publish. It waits on: full batches (bounded by
`learner.wait_for_batch_timeout_s`) and collectives (bounded by `learner.dist_timeout_s`). It unblocks generators
by publishing each version (every `weightsync.every_steps` steps), which raises admission. Everything a checkpoint
must keep besides the model and optimizer is one `LearnerState` (learner/state.py); a restarted job resumes from its
newest checkpoint (`learner.resume=auto`) at the same version.
"""
import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from asyncrl.configs.sections import part_seed
from asyncrl.data.prompts import PromptSet
from asyncrl.learner.build import (StepParts, build_optimizer, build_policy, build_step_parts, checkpoint_root,
                                   find_resume_point, vision_processor)
from asyncrl.learner.checkpoint import (CheckpointWriteFailed, load_checkpoint, save_checkpoint,
                                        wait_for_pending_save)
from asyncrl.learner.collect import collect_batch
from asyncrl.learner.critic import build_critic
from asyncrl.learner.prm import build_prm
from asyncrl.learner.host import LearnerHost
from asyncrl.learner.learnable import NothingToLearn
from asyncrl.learner.liger_head import check_liger_available
from asyncrl.learner.lr_schedule import resync_after_load
from asyncrl.learner.parallel import ParallelState, broadcast_object
from asyncrl.learner.precision import resolve_autocast
from asyncrl.learner.publish import GatherSettings, outgoing_version
from asyncrl.learner.state import AckLedger, LearnerState
from asyncrl.learner.step_metrics import warn_on_mismatch
from asyncrl.learner.train_step import PoisonedBatch, StepSettings, train_step
from asyncrl.moe.routing import RoutingReplay, routing_shape

log = logging.getLogger(__name__)


class TrainingPoisoned(RuntimeError):
    """learner.max_consecutive_skips steps in a row could not train: the job stops instead of spinning."""


@dataclass(frozen=True)
class LoopSettings:
    """What the loop reads at every step, taken from the config once (`loop_settings`), so the step's functions
    say what they use."""

    algo: object
    """The algo section (train_step's)."""
    step: StepSettings
    """train_step's settings; each step fills in its version."""
    groups_per_step: int
    max_staleness: int
    wait_for_batch_timeout_s: float
    publish_every: int
    """weightsync.every_steps."""
    total_steps: int
    max_consecutive_skips: int
    gather: GatherSettings


def loop_settings(cfg, parallel: ParallelState, routing=None, vision=None) -> LoopSettings:
    """The loop's settings from the run's config: the one place the loop reads the whole of it. `routing`: the
    policy's RoutingReplay when learner.moe_routing_replay; `vision`: a vision-language policy's VisionProcessor."""
    learner = cfg.learner
    step = StepSettings(version=0, max_staleness=cfg.buffer.max_staleness,
                        max_tokens_per_microbatch=learner.max_tokens_per_microbatch,
                        chunk_tokens=learner.logprob_chunk_tokens, grad_clip=learner.grad_clip,
                        seed=part_seed(learner.seed, cfg.job.seed),
                        packing=learner.packing, fp32_head=cfg.model.lm_head_fp32,
                        autocast=resolve_autocast(learner.autocast, parallel.device), parallel=parallel,
                        routing=routing, liger=learner.liger, vision=vision)
    if learner.autocast == "auto":
        log.info("learner: learner.autocast=auto on %s: %s", parallel.device,
                 f"{step.autocast} autocast (bf16 is native here)" if step.autocast else "off (no native bf16 here)")
    gather = GatherSettings(learner.lora, cfg.weightsync.dtype, int(learner.gather_bucket_mb * 2**20))
    return LoopSettings(cfg.algo, step, cfg.buffer.groups_per_step, cfg.buffer.max_staleness,
                        learner.wait_for_batch_timeout_s, cfg.weightsync.every_steps, learner.total_steps,
                        learner.max_consecutive_skips, gather)


def run_learner(cfg, model_path: str, train_files: list, job_dir: str,
                parallel: ParallelState | None = None, prompts: PromptSet | None = None,
                eval_prompts: PromptSet | None = None) -> dict | None:
    """Trains the whole job on this rank; returns the summary on rank 0 (also written to job_dir/summary.json),
    None on the others. `prompts`: the job's prompts, read on rank 0 (data/prompts.py::load_train_prompts); with
    them, rank 0 deals them to the generators (buffer/dealing.py) and the job also ends when data.epochs are trained;
    `eval_prompts` likewise are the held-out prompts evaluated on the fleet (buffer/eval_rounds.py)."""
    parallel = parallel or ParallelState()
    torch.manual_seed(part_seed(cfg.learner.seed, cfg.job.seed))
    if cfg.learner.torch_threads:
        torch.set_num_threads(cfg.learner.torch_threads)
    if cfg.learner.liger:
        check_liger_available()
    model = build_policy(cfg.learner, cfg.model.trust_remote_code, model_path, parallel).train()
    routing = RoutingReplay(model, *routing_shape(model.config)) if cfg.learner.moe_routing_replay else None
    optimizer, scheduler = build_optimizer(model, cfg.learner)
    parts = build_step_parts(cfg.algo, cfg.learner, cfg.model.trust_remote_code, model_path, parallel)
    parts.critic = (build_critic(cfg.critic, cfg.learner, cfg.model.trust_remote_code, model_path, parallel)
                    if cfg.algo.needs_critic() else None)
    parts.prm = (build_prm(cfg.prm, cfg.learner, cfg.model.trust_remote_code, model_path, parallel)
                 if cfg.algo.needs_prm() else None)
    resume_from = find_resume_point(cfg.learner, job_dir)
    state = (load_checkpoint(resume_from, model, optimizer, scheduler, critic=parts.critic, prm=parts.prm)
             if resume_from else LearnerState())
    if resume_from:
        resync_after_load(scheduler)  # this job's schedule (learner.total_steps may have grown) at the restored step
    parts.restore(state)
    host = LearnerHost(cfg, model, model_path, train_files, job_dir, parallel, state, resumed_from=resume_from,
                       prompts=prompts, eval_prompts=eval_prompts) if parallel.is_main else None
    acks = AckLedger(host.buffer if host is not None else None, state)
    start_version, status, tell_generators = state.version, "FAILED", False
    loop = loop_settings(cfg, parallel, routing, vision_processor(model, model_path, cfg.data))
    try:
        publish_weights(model, parallel, host, state.version, loop.gather)
        if host is not None:
            host.start()
        data_left = True
        while state.version < cfg.learner.total_steps and data_left:
            trained, data_left = train_one_version(model, optimizer, scheduler, host, parallel, state, parts, loop)
            acks.note_taken()
            if trained:  # a skipped step left the version where it was: nothing new to save
                checkpoint_if_due(cfg.learner, job_dir, model_path, model, optimizer, scheduler, state, acks,
                                  last=not data_left, critic=parts.critic, prm=parts.prm)
        wait_for_pending_save()
        acks.all_saved()
        if host is not None:
            host.finish_evals()
        status = "FINISHED"
    except NothingToLearn:  # the learner's own decision: the generators hear "done" and stop, as at the end
        tell_generators = True
        raise
    finally:
        if host is not None:
            host.close(status, tell_generators=tell_generators or status == "FINISHED")
    return host.summary(state, start_version) if host is not None else None


def train_one_version(model, optimizer, scheduler, host: LearnerHost | None, parallel: ParallelState,
                      state: LearnerState, parts: StepParts, loop: LoopSettings) -> tuple[bool, bool]:
    """Take a batch, train on it (state.version -> +1), publish when due, and (rank 0) log the step. Returns
    (trained: False when the batch poisoned the step (skip_poisoned_step) or the data had ended with nothing left:
    nothing moved, data left: False once the dealer's last epoch is taken)."""
    version = state.version
    groups, dropped, collected, final = next_batch(host, parallel, version, parts, loop)
    if not groups:  # the data ended with the previous batch
        return False, False
    settings = dataclasses.replace(loop.step, version=version)
    try:
        result = train_step(model, optimizer, scheduler, groups, loop.algo, settings, ref_model=parts.ref_model,
                            kl_controller=parts.kl_controller, critic=parts.critic, prm=parts.prm)
        cause = None if result.stepped else "the gradient was not finite in every mini-batch"
    except PoisonedBatch as err:
        cause = str(err)
    except Exception as err:
        quarantine_failed_step(host, version, groups, err)
        raise
    if cause is not None:
        skip_poisoned_step(host, state, parts, groups, dropped, cause, loop.max_consecutive_skips)
        return False, True
    metrics = result.metrics
    state.version = version + 1
    state.skipped_in_a_row = 0
    if host is not None:  # rank 0 speaks for the step, numbered as the progress log numbers it (the new version)
        warn_on_mismatch(metrics, state.version, host.trust.per_generator(groups, result.group_abs_diff))
        host.trust.note(groups, result.group_abs_diff, state.version)
    state.record_batch(groups, dropped)
    state.kl_coef = parts.kl_controller.value
    started = time.perf_counter()
    published = final or should_publish(state.version, loop.publish_every, loop.total_steps)
    if published:  # a step with no gradient at all (every advantage 0) may rightly leave the weights as they were
        publish_weights(model, parallel, host, state.version, loop.gather, moved=result.moved)
    if host is not None:
        if published:
            metrics["timing/weightsync/publish_s"] = time.perf_counter() - started
        host.after_step(state, groups, collected, metrics)
    return True, not final


def skip_poisoned_step(host: LearnerHost | None, state: LearnerState, parts: StepParts, groups: list,
                       dropped: Counter, cause: str, max_in_a_row: int) -> None:
    """A batch that poisoned its step is never trained: no optimizer step was taken (train_step saw to that), the
    version and the published weights stay, the KL coefficient goes back to its value before the step, and the
    groups are quarantined (counted under buffer/rejected/poisoned_step, their admissions given back, dead-lettered
    with Redis) so the next batch replaces them. The same on every rank: they all saw the same groups and norms.
    `max_in_a_row` skips in a row stop the job (TrainingPoisoned): a run that can no longer train is not hidden."""
    state.skipped_steps += 1
    state.skipped_in_a_row += 1
    state.record_batch([], {**dropped, "poisoned_step": len(groups)})
    if state.kl_coef is not None:
        parts.kl_controller.value = state.kl_coef
    if host is not None:
        log.warning("learner v%d: skipped the step (%s); groups %s from %s are quarantined", state.version, cause,
                    [group.group_id for group in groups], sorted({group.generator_id for group in groups}))
        host.buffer.quarantine(groups, "poisoned_step")
        host.record.log({"learner/skipped_steps": float(state.skipped_steps)}, step=state.version)
    if state.skipped_in_a_row >= max_in_a_row:  # on every rank: they all count alike
        raise TrainingPoisoned(f"{state.skipped_in_a_row} steps in a row at v{state.version} could not train "
                               f"(learner.max_consecutive_skips={max_in_a_row}); the last: {cause}")


def quarantine_failed_step(host: LearnerHost | None, version: int, groups: list, err: Exception) -> None:
    """A step that failed with an error the guard does not know (the job stops with it): its groups are quarantined
    first, under `failed_step`, so a restarted learner does not fail on the same groups again (with Redis they would
    still be pending, and each restart would re-read them). They are kept, whole, in the dead-letter stream; with zmq
    nothing outlives the process anyway. Quarantining must never hide the error itself."""
    if host is None:
        return
    log.error("learner v%d: the step failed (%s: %s); its groups %s from %s are quarantined so a restarted learner "
              "does not fail on them again", version, type(err).__name__, err, [group.group_id for group in groups],
              sorted({group.generator_id for group in groups}))
    try:
        host.buffer.quarantine(groups, "failed_step")
    except Exception:  # the buffer itself may be what failed
        log.exception("learner v%d: could not quarantine the failed step's groups", version)


def should_publish(version: int, every_steps: int, total_steps: int) -> bool:
    """Whether the weights of `version` are published: every `every_steps` versions, and always the last one (so the
    fleet and anyone evaluating it see the final weights). The same answer on every rank: they all gather."""
    return version % every_steps == 0 or version >= total_steps


class BatchUnavailable(RuntimeError):
    """Rank 0 could not assemble a batch; the other ranks stop with its message."""


def next_batch(host: LearnerHost | None, parallel: ParallelState, version: int, parts: StepParts, loop: LoopSettings):
    """Rank 0 collects the step's groups from the buffer (loop.groups_per_step of them, none staler than
    loop.max_staleness against the trained `version`) and sends them, with what it dropped on the way, to every
    rank, so every rank's LearnerState stays the same. Returns (groups, dropped counts, Collected on rank 0 / None,
    whether the data ended with these groups).
    A failure on rank 0 is sent too, so no rank waits in a collective forever."""
    collected, message = None, None
    if host is not None:
        try:
            collected = collect_batch(host.buffer, loop.groups_per_step, loop.max_staleness, version,
                                      loop.wait_for_batch_timeout_s, parts.batch_filter,
                                      data_done=host.data_done, watch=host.learnable.check,
                                      refuse=host.trust.refusal)
            attach_images(collected.groups, host.images)
            message = ("groups", (collected.groups, dict(collected.dropped), collected.final))
        except Exception as err:
            broadcast_object(("error", f"{type(err).__name__}: {err}"), parallel)
            raise
    kind, payload = broadcast_object(message, parallel)
    if kind == "error":
        raise BatchUnavailable(f"rank 0 could not assemble batch v{version}: {payload}")
    groups, dropped, final = payload
    return groups, Counter(dropped), collected, final


def attach_images(groups: list, images: dict) -> None:
    """Each group of a multimodal prompt gets the prompt's images from the learner's own copy of the row it dealt
    (`prompt_id`, which the buffer checked against the deal along with the prompt's tokens): a generator's group
    never brings pixels of its own."""
    if images:
        for group in groups:
            group.images = images.get(group.prompt_id)


def publish_weights(model, parallel: ParallelState, host: LearnerHost | None, version: int, gather: GatherSettings,
                    moved: bool = True) -> None:
    """Gather the full weights bucket by bucket on every rank; rank 0 publishes `version` (the publisher casts to
    weightsync.dtype as it copies each tensor into its ring), then tells the buffer: only now may generators be
    admitted against it (buffer/staleness.py). With learner.lora only the adapter is gathered and published, named
    as PEFT's adapter files name it, with its settings in the announcement: the engines serve it as an
    adapter on the base model they already hold (generator/engines/lora_adapter.py)."""
    outgoing = outgoing_version(model, parallel, gather.lora, gather.dtype, gather.bucket_bytes)
    if host is None:
        for _ in outgoing.weights:  # nothing is yielded here; iterating runs this rank's side of the gathers
            pass
        return
    host.publish(outgoing.weights, version, outgoing.specs, extra=outgoing.extra, full_bytes=outgoing.full_bytes,
                 moved=moved)


def checkpoint_if_due(learner, job_dir: str, model_path: str, model, optimizer, scheduler, state: LearnerState,
                      acks: AckLedger, last: bool = False, critic=None, prm=None) -> None:
    """Every learner.checkpoint_every steps and after the last (learner.total_steps, or `last`: the data ended);
    with checkpoints off, the buffer may forget each batch at once (there is nothing to resume from). The critic
    or the PRM, when there is one, is saved with the policy. `learner` is the learner section."""
    every = learner.checkpoint_every
    if not every:
        acks.checkpointed(background=False)
        return
    if state.version % every and state.version != learner.total_steps and not last:
        return
    try:
        save_checkpoint(checkpoint_root(learner.checkpoint_dir, job_dir), model, optimizer, scheduler, state,
                        learner.checkpoint_keep, model_dir=model_path, async_save=learner.checkpoint_async,
                        critic=critic, prm=prm)
    except CheckpointWriteFailed as err:
        # a full disk must not end a job that can train on: the buffer keeps every group not yet covered by a
        # checkpoint (no acks), and the next checkpoint tries again; the last one is still whole
        state.checkpoint_failures += 1
        log.error("learner v%d: %s; training goes on, the next checkpoint tries again (failures so far: %d)",
                  state.version, err, state.checkpoint_failures)
        if last:
            raise
        return
    acks.checkpointed(background=learner.checkpoint_async)
