"""Building the learner's pieces from the config: the policy (loaded, Ulysses, FSDP2), the optimizer and schedule,
the per-step parts (reference model, KL controller, batch filter), and where to resume from. Free functions with
explicit arguments, in the order run_learner (learner/loop.py) and the SFT job (learner/sft_job.py) call them."""
import functools
import logging
import os
from dataclasses import dataclass

import torch

from asyncrl.algos.kl import AdaptiveKLController, FixedKLController
from asyncrl.algos.offpolicy_plan import OffPolicyPlan
from asyncrl.data.vision import VisionError, VisionProcessor, is_vision
from asyncrl.learner.checkpoint import CheckpointError, latest_checkpoint, read_state, resolve_checkpoint
from asyncrl.learner.collect import BatchFilter
from asyncrl.learner.lora import apply_lora, trainable_parameters
from asyncrl.learner.lr_schedule import lr_multiplier
from asyncrl.learner.model import load_model
from asyncrl.learner.parallel import ParallelState, apply_fsdp
from asyncrl.learner.precision import use_fp32_attention, wants_fp32_attention
from asyncrl.learner.state import LearnerState
from asyncrl.learner.ulysses import apply_ulysses

log = logging.getLogger(__name__)


def build_policy(learner, trust_remote_code: bool, model_path: str, parallel: ParallelState, adapters: bool = True):
    """The HF model on this rank: loaded, with learner.lora's adapters injected when `adapters` and LoRA is on
    (before the wrapping, so FSDP2 shards them like any parameter), routed through Ulysses when sp_size > 1, then
    FSDP2-sharded. The reference model is the base model: adapters=False. `learner` is the learner section;
    `trust_remote_code` is model.trust_remote_code."""
    model = load_model(model_path, learner.dtype, trust_remote_code, learner.attn_implementation)
    if is_vision(model.config):
        refuse_for_vision(learner, parallel)
        if learner.freeze_vision:
            model.model.visual.requires_grad_(False)
    if adapters and learner.lora.enabled:
        model = apply_lora(model, learner.lora)
    return shard_model(model, learner, parallel)


def refuse_for_vision(learner, parallel: ParallelState) -> None:
    """What a vision-language policy cannot do here, said before anything is built (docs/vision.md): Ulysses would
    split an image's patches over ranks, and LoRA's and routing replay's module names are the text model's."""
    if parallel.sp_size > 1:
        raise VisionError("learner.sp_size > 1 with a vision-language model: Ulysses would split an image's patches "
                          "over ranks; use sp_size 1")
    if learner.lora.enabled:
        raise VisionError("learner.lora with a vision-language model: not supported (its target modules would also "
                          "match the vision tower's MLPs)")
    if learner.moe_routing_replay:
        raise VisionError("learner.moe_routing_replay with a vision-language model: not supported")


def refuse_vision_job(cfg, deals: bool) -> None:
    """The job-level settings a vision-language policy cannot take (docs/vision.md): its images reach the learner
    from the rows it deals, so the learner must deal them (not generators walking their own copy, not scripted
    clients); episodes render their openings in environments, without images; the critic and the implicit PRM are
    text models."""
    if not deals:
        raise VisionError("a vision-language model trains on rows the learner deals (data.train_files or "
                          "data.source on the learner): the learner reads each group's images from its own copy")
    if cfg.samples_episodes():
        raise VisionError("a vision-language model with episodes (tools, environments, agents): not supported")
    if cfg.algo.needs_critic() or cfg.algo.needs_prm():
        raise VisionError("a vision-language model with a critic or an implicit PRM: not supported")


def vision_processor(model, model_path: str, data_cfg):
    """A vision-language policy's VisionProcessor (data/vision.py), bounded as data.max_image_pixels says; None
    for a text model."""
    if not is_vision(model.config):
        return None
    return VisionProcessor.from_model_dir(model_path, model.config, data_cfg.max_image_pixels)


def shard_model(model, learner, parallel: ParallelState):
    """A loaded model (the policy, its reference, the critic) on this rank's device, through Ulysses when
    sp_size > 1, then FSDP2-sharded with the learner section's precision, offload and checkpointing settings. On
    CPU, low-precision compute (learner.autocast, or bf16 parameters) gets fp32 attention (learner/precision.py)."""
    model.to(parallel.device)
    if wants_fp32_attention(parallel.device, learner.param_dtype or learner.dtype, learner.autocast):
        use_fp32_attention(model)
    if parallel.sp_size > 1:
        apply_ulysses(model, parallel.sp_group, parallel.sp_size, learner.sp_impl)
    return apply_fsdp(model, parallel, param_dtype=learner.param_dtype or learner.dtype,
                      reduce_dtype=learner.reduce_dtype, cpu_offload=learner.cpu_offload,
                      activation_checkpointing=learner.activation_checkpointing)


def build_optimizer(model, learner_cfg):
    """AdamW over the parameters that train (with LoRA, the adapters alone) with a linear warmup over
    learner.warmup_steps, then learner.lr_schedule (learner/lr_schedule.py)."""
    if learner_cfg.lr_schedule != "constant" and learner_cfg.warmup_steps >= learner_cfg.total_steps:
        log.warning("learner: learner.total_steps=%d ends within learner.warmup_steps=%d: the rate rises to %.3g of "
                    "learner.lr and the %s decay never starts", learner_cfg.total_steps, learner_cfg.warmup_steps,
                    lr_multiplier(learner_cfg.total_steps - 1, warmup_steps=learner_cfg.warmup_steps,
                                  total_steps=learner_cfg.total_steps), learner_cfg.lr_schedule)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=learner_cfg.lr, betas=(learner_cfg.adam_beta1, learner_cfg.adam_beta2),
                                  weight_decay=learner_cfg.weight_decay, fused=fused_adamw(params) or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_multiplier, warmup_steps=max(learner_cfg.warmup_steps, 0), total_steps=learner_cfg.total_steps,
        schedule=learner_cfg.lr_schedule, min_ratio=learner_cfg.min_lr_ratio))
    return optimizer, scheduler


def fused_adamw(params: list) -> bool:
    """Whether AdamW takes its fused kernel: for plain (unsharded) CPU tensors. There torch's default is the
    one-tensor-at-a-time loop (its multi-tensor path is for accelerators), a dozen small ops per parameter that
    took 3-7 ms of the demo's step against 1.1-1.4 ms fused; the update is AdamW's, equal to about 1 ulp. Sharded
    (DTensor) and accelerator parameters keep torch's default."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(param.device.type == "cpu" and not isinstance(param, DTensor) for param in params)


@dataclass
class StepParts:
    """What every step uses besides the model and optimizer: the frozen reference model (None unless a KL
    coefficient is > 0 or PRIME measures its PRM against it), the reward-KL controller, the batch filter, PPO's critic
    (learner/critic.py; None unless the algorithm reads values) and PRIME's PRM (learner/prm.py; None unless the
    algorithm reads process rewards)."""

    ref_model: object
    kl_controller: object
    batch_filter: BatchFilter
    critic: object = None
    prm: object = None

    def restore(self, state: LearnerState) -> None:
        """Put back what a checkpoint kept: the controller's coefficient (the adaptive one moves every step); a
        fresh state takes the controller's starting value, so a skipped first step has one to go back to."""
        if state.kl_coef is None:
            state.kl_coef = self.kl_controller.value
        else:
            self.kl_controller.value = float(state.kl_coef)


def build_step_parts(algo, learner, trust_remote_code: bool, model_path: str, parallel: ParallelState) -> StepParts:
    """Loading the reference costs a second copy of the weights, so nothing loads it by default (`learner` and
    `trust_remote_code` build it as build_policy does)."""
    ref_model = None
    if algo.needs_reference_model():
        ref_model = build_policy(learner, trust_remote_code, model_path, parallel, adapters=False).eval()
        ref_model.requires_grad_(False)
        log.info("learner: loaded the reference model (%s) from %s",
                 "PRIME's PRM" if algo.needs_prm() else "the KL term", model_path)
    if algo.kl_controller == "adaptive":
        controller = AdaptiveKLController(algo.kl_reward_coef, algo.kl_target, algo.kl_horizon)
    else:
        controller = FixedKLController(algo.kl_reward_coef)
    batch_filter = BatchFilter(dynamic_sampling=algo.dynamic_sampling,
                               needs_baseline=OffPolicyPlan.from_algo(algo).greedy_baseline)
    return StepParts(ref_model, controller, batch_filter)


def checkpoint_root(checkpoint_dir: str | None, job_dir: str) -> str:
    """learner.checkpoint_dir, else the job directory's checkpoints/ (a fresh job directory never resumes by
    accident; a fixed checkpoint_dir, or ASYNCRL_JOB_DIR reused, makes restarts pick up where they stopped)."""
    return checkpoint_dir or os.path.join(job_dir, "checkpoints")


def find_resume_point(learner, job_dir: str) -> str | None:
    """The checkpoint to start from, per learner.resume ("auto", "never" or a path) of the learner section."""
    if learner.resume == "never":
        return None
    if learner.resume == "auto":
        found = latest_checkpoint(checkpoint_root(learner.checkpoint_dir, job_dir))
    else:
        found = resolve_checkpoint(learner.resume)
    if found is not None:
        version = read_state(found).version
        if version >= learner.total_steps:
            raise CheckpointError(
                f"checkpoint {found} is at version {version} >= learner.total_steps={learner.total_steps}: that "
                f"job already finished. Raise learner.total_steps to train on, or set learner.resume=never (or "
                f"another learner.checkpoint_dir) to start over")
    return found
