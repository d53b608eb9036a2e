"""PRIME's implicit process reward model (algo.advantage=prime): built, run and trained beside the policy.

The PRM is a causal LM of the policy's architecture (`prm.model_path`, else the policy's starting weights, as verl's
recipe does), routed through Ulysses and FSDP2-sharded exactly like the policy (learner/build.py), and it reads the
batch through the same micro-batches and the same logprob path. Its token reward is β log(π_φ(y_t)/π_ref(y_t)) against
the frozen reference model (the policy's starting weights, loaded because `algo.needs_reference_model`), and it
learns with PRIME's binary cross-entropy from the outcome rewards alone (algos/prime.py).

Each step (learner/train_step.py), with prm.update=before (verl's default): `train_prm` takes one optimizer step on
the batch, then a no-grad pass of the updated PRM over the batch gives its token rewards (`process_rewards`) and the
advantages are computed from those token rewards and the outcome rewards; with update=after it scores with its
step-start weights and trains once the policy has stepped; with update=none it only scores. Its collectives follow
the policy's: every rank runs as many passes.
"""
import dataclasses
from dataclasses import dataclass

import torch

from asyncrl.algos.prime import implicit_process_rewards, prm_loss, prm_pair_accuracy
from asyncrl.learner.batch import Batch, placeholder_microbatch, scatter_rows
from asyncrl.learner.build import build_optimizer, build_policy
from asyncrl.learner.optimizer_step import losses_finite, optimizer_step
from asyncrl.learner.parallel import ParallelState, all_reduce_sum


@dataclass
class ImplicitPRM:
    """The PRM on this rank with its own optimizer and schedule, and its settings (`prm` section)."""

    model: object
    optimizer: object
    scheduler: object
    cfg: object


def build_prm(prm, learner, trust_remote_code: bool, policy_path: str, parallel: ParallelState) -> ImplicitPRM:
    """The PRM on this rank (`prm`, `learner`: those config sections): the whole model trains (never LoRA adapters:
    its log-ratio to the reference is the reward, and it has no base of its own to keep), with its AdamW at prm.lr,
    constant."""
    model = build_policy(learner, trust_remote_code, prm.model_path or policy_path, parallel, adapters=False).train()
    optimizer_cfg = dataclasses.replace(learner, lr=prm.lr, weight_decay=prm.weight_decay, warmup_steps=0,
                                        lr_schedule="constant", min_lr_ratio=0.0)
    optimizer, scheduler = build_optimizer(model, optimizer_cfg)
    return ImplicitPRM(model, optimizer, scheduler, prm)


def outcome_labels(batch: Batch) -> torch.Tensor:
    """[B] each completion's outcome reward: the sum of its token rewards (the verifier's score on its last token),
    the PRM's label and PRIME's outcome term. Never the KL-penalised rewards: the PRM learns what the verifier said."""
    return torch.where(batch.loss_mask.bool(), batch.token_rewards, torch.zeros_like(batch.token_rewards)).sum(-1)


def process_rewards(prm_logprobs: torch.Tensor, batch: Batch, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(token rewards [B, L-1], log-ratios [B, L-1]) of the whole batch from the PRM's logprobs of it (the train
    step's no-grad pass, learner/train_step.py::compute_batch_logprobs): β q_t with q_t = log π_φ - log π_ref
    (batch.logprobs_ref), normalised as `cfg` (the prm section) says."""
    valid = batch.loss_mask.bool()
    log_ratio = torch.where(valid, prm_logprobs - batch.logprobs_ref, torch.zeros_like(prm_logprobs))
    return implicit_process_rewards(log_ratio, batch.loss_mask, cfg.beta, cfg.norm), log_ratio


def train_prm(prm: ImplicitPRM, batch: Batch, group_size: int, settings) -> dict:
    """One optimizer step of the PRM on the whole batch: PRIME's cross-entropy of σ(β Σ_t q_t) against each
    completion's outcome (outcome_labels), the mean over the batch's rows of every rank. A non-finite loss or
    gradient norm on any rank skips the step, as for the policy. Returns prm/* metrics; prm/pair_accuracy is how
    often the PRM ordered the batch's pairs as their outcomes before this step (verl's dpo_acc): the PRM's accuracy
    on completions it had not trained on."""
    parallel = settings.parallel
    labels = outcome_labels(batch)
    rows_total = float(batch.num_rows)
    loss_total, parts = 0.0, []
    for micro in settings.microbatches(batch):
        if micro is None:
            logprobs, _ = settings.logprobs(prm.model, placeholder_microbatch(batch).to(parallel.device))
            (logprobs.sum() * 0.0).backward()
            continue
        micro = micro.to(parallel.device)
        logprobs, _ = settings.logprobs(prm.model, micro)
        log_ratio = logprobs - micro.logprobs_ref
        per_row = prm_loss(log_ratio, micro.loss_mask, labels[micro.rows].to(parallel.device), prm.cfg.beta)
        loss = per_row.sum() / rows_total
        (loss * parallel.loss_scale).backward()
        loss_total += float(loss.detach())
        summed = torch.where(micro.loss_mask.bool(), log_ratio.detach(), torch.zeros_like(log_ratio)).sum(-1)
        parts.append((micro.rows, summed.cpu()[:, None]))
    grad_norm, took = optimizer_step(prm.model, prm.optimizer, prm.scheduler, prm.cfg.grad_clip,
                                     losses_finite(loss_total, parallel))
    sums = scatter_rows((batch.num_rows, 1), parts)
    if parallel.dp_group is not None:  # each DP rank holds its rows' share; SP ranks of a group hold the same
        shares = all_reduce_sum(torch.cat([torch.tensor([loss_total], dtype=torch.float32), sums[:, 0].float()])
                                .to(parallel.device), parallel.dp_group).cpu()
        loss_total, sums = float(shares[0]), shares[1:, None]
    return {
        "prm/loss": loss_total,
        "prm/grad_norm": grad_norm,
        "prm/lr": prm.scheduler.get_last_lr()[0],
        "prm/skipped": float(not took),
        "prm/pair_accuracy": prm_pair_accuracy(sums[:, 0], labels, group_size),
    }


def process_metrics(rewards: torch.Tensor, log_ratio: torch.Tensor, loss_mask: torch.Tensor) -> dict:
    """What the step's advantages took from the PRM: its token rewards' mean and mean |.|, and the mean summed
    log-ratio per completion (how far π_φ has moved from π_ref on what the policy samples)."""
    valid = loss_mask.bool()
    count = max(int(valid.sum()), 1)
    rows = max(int((valid.sum(-1) > 0).sum()), 1)
    return {
        "prm/token_reward/mean": float(rewards[valid].sum()) / count,
        "prm/token_reward/abs_mean": float(rewards[valid].abs().sum()) / count,
        "prm/log_ratio/seq_mean": float(torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum()) / rows,
    }
