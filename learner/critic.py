"""PPO's value model (algo.advantage=gae, algo.vtrace_values=critic): built, run and trained beside the policy.

The critic is the policy's architecture with a scalar head: an HF `AutoModelForTokenClassification` with one label,
from `critic.model_path` or initialised from the policy's weights (body copied, head zero: the first values are 0
and the first advantages are the plain returns). It is routed through Ulysses and FSDP2-sharded exactly like the
policy (learner/build.py), and it reads the batch through the same streams (padded or packed, split over the SP
group) as the policy's logprobs (learner/logprobs.py), so V_t sits where the logprob of token t+1 sits.

Each step (learner/train_step.py): `compute_batch_values` (no grad, whole batch) gives the values the advantages
are computed from; after the policy's update, `train_critic` regresses them onto the returns with the clipped
value loss (algos/value_loss.py), over the same mini-batches as the policy, with its own optimizer, learning rate,
gradient clip and micro-batch budget. Its collectives follow the policy's: every rank runs as many passes.
"""
import dataclasses
import logging
from dataclasses import dataclass

import torch

from asyncrl.algos.losses import aggregate_loss
from asyncrl.algos.value_loss import compute_value_loss, explained_variance
from asyncrl.learner.batch import Batch, placeholder_microbatch, plan_microbatches, scatter_rows, split_minibatches
from asyncrl.learner.build import build_optimizer, shard_model
from asyncrl.learner.logprobs import packed_stream, pad_columns, padded_stream, run_decoder, unpack, unpad
from asyncrl.learner.model import check_model_dir, resolve_attn_implementation
from asyncrl.learner.optimizer_step import losses_finite, optimizer_step
from asyncrl.learner.parallel import ParallelState, all_reduce_sum
from asyncrl.learner.ulysses import gather_sequence
from asyncrl.weightsync.dtypes import DTYPES

log = logging.getLogger(__name__)

VALUE_HEAD = "score"
"""The scalar head's name in HF's token-classification models."""


@dataclass
class Critic:
    """The value model on this rank with its own optimizer and schedule, and its settings (`critic` section)."""

    model: object
    optimizer: object
    scheduler: object
    cfg: object

    def in_warmup(self, version: int) -> bool:
        """Whether the step from `version` trains the critic alone (critic.warmup_steps)."""
        return version < self.cfg.warmup_steps


def load_value_model(path: str, dtype: str = "float32", trust_remote_code: bool = False,
                     attn_implementation: str = "sdpa"):
    """A one-label `AutoModelForTokenClassification` from a local HF directory. A causal LM's directory gives its
    body and a new head, set to zero (HF would draw it at random, and random first values only add noise to the
    first advantages); a critic's directory keeps its head. No dropout on the head: values must be the same
    function in the no-grad pass and in training, and the same on every rank."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    check_model_dir(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, num_labels=1)
    config.classifier_dropout = 0.0  # not a field of decoder configs: set, so the head reads it (HF's default is 0.1)
    model, info = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, output_loading_info=True,
        attn_implementation=resolve_attn_implementation(attn_implementation, config))
    head = getattr(model, VALUE_HEAD)
    if any(key.startswith(f"{VALUE_HEAD}.") for key in info["missing_keys"]):
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
        log.info("critic: body from %s, a new value head set to zero", path)
    return model


def build_critic(critic, learner, trust_remote_code: bool, policy_path: str, parallel: ParallelState) -> Critic:
    """The critic on this rank (`critic`, `learner`: those config sections): loaded (critic.model_path, else the
    policy's directory), through Ulysses and FSDP2 with the learner's settings, and its AdamW at critic.lr (constant:
    the critic has no schedule of its own)."""
    model = load_value_model(critic.model_path or policy_path, learner.dtype, trust_remote_code,
                             learner.attn_implementation)
    model = shard_model(model, learner, parallel).train()
    optimizer_cfg = dataclasses.replace(learner, lr=critic.lr, weight_decay=critic.weight_decay,
                                        warmup_steps=0, lr_schedule="constant", min_lr_ratio=0.0)
    optimizer, scheduler = build_optimizer(model, optimizer_cfg)
    return Critic(model, optimizer, scheduler, critic)


def value_states(model, **inputs) -> torch.Tensor:
    """[R, S] values: the head's one output at every position, through the root module's forward (FSDP2's hooks)."""
    logits = model(**inputs, use_cache=False).logits  # [R, S, 1]
    return logits[..., 0].to(torch.promote_types(logits.dtype, torch.float32))


def compute_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False,
                   sp_group=None) -> torch.Tensor:
    """V of the state after tokens <= t, shape [B, L-1] (fp32), aligned with the logprob of token t+1: the value
    each generated token's advantage is measured against. Padded, packed or split over an SP group like
    `compute_logprobs`; with grad when grad is enabled."""
    ones = torch.ones(input_ids.shape[0])
    stream = packed_stream(input_ids, attention_mask, ones) if packed else padded_stream(input_ids, attention_mask,
                                                                                          ones)
    sp_size = torch.distributed.get_world_size(sp_group) if sp_group is not None else 1
    if sp_size > 1:
        stream = pad_columns(stream, sp_size)
        rank, width = torch.distributed.get_rank(sp_group), stream.ids.shape[1] // sp_size
        local = slice(rank * width, (rank + 1) * width)
        values = value_states(model, input_ids=stream.ids[:, local], position_ids=stream.positions[:, local],
                              segment_ids=stream.segments)  # [R, s]
        values = gather_sequence(values, sp_group)  # [R, S]
    else:
        values = run_decoder(model, stream, forward=value_states)
    return (unpack if packed else unpad)(values, attention_mask)


def micro_values(model, micro: Batch, settings) -> torch.Tensor:
    """Values [b, l] of a micro-batch already on the learner's device."""
    return compute_values(model, micro.input_ids, micro.attention_mask, packed=settings.packing,
                          sp_group=settings.parallel.sp_group)


def critic_microbatches(batch: Batch, critic: Critic, settings) -> list:
    """This rank's critic micro-batches (None = a placeholder pass), within critic.max_tokens_per_microbatch
    (0: the learner's budget) per rank."""
    parallel = settings.parallel
    budget = critic.cfg.max_tokens_per_microbatch or settings.max_tokens_per_microbatch
    return plan_microbatches(batch, budget * parallel.sp_size, parallel.dp_rank, parallel.dp_size)


@torch.no_grad()
def compute_batch_values(critic: Critic, batch: Batch, settings) -> torch.Tensor:
    """No-grad values [B, L-1] of the whole batch (0 off the rows' lengths); each DP rank computes its rows and a
    sum over the DP group (rows are disjoint) gives every rank the whole batch."""
    parts, device = [], settings.parallel.device
    for micro in critic_microbatches(batch, critic, settings):
        if micro is None:  # FSDP's all-gathers must run on every rank
            micro_values(critic.model, placeholder_microbatch(batch).to(device), settings)
            continue
        parts.append((micro.rows, micro_values(critic.model, micro.to(device), settings).cpu()))
    full = scatter_rows(tuple(batch.loss_mask.shape), parts)
    if settings.parallel.dp_group is None:
        return full
    return all_reduce_sum(full.to(device), settings.parallel.dp_group).cpu()


def train_critic(critic: Critic, batch: Batch, minibatches: int, settings) -> dict:
    """One optimizer step of the critic per mini-batch (the policy's split): the clipped value loss of
    `batch.values` (the step-start values) against `batch.returns`, token-mean over the mini-batch's tokens of every
    rank. A non-finite loss or gradient norm on any rank skips that step, as for the policy. Returns critic/*
    metrics for the whole batch (every rank's share summed)."""
    parallel = settings.parallel
    loss_total, sums, grad_norms, stepped = 0.0, torch.zeros(3, dtype=torch.float64), [], 0
    for mini in split_minibatches(batch, minibatches):
        tokens = float(mini.loss_mask.sum())
        mini_loss = 0.0
        for micro in critic_microbatches(mini, critic, settings):
            if micro is None:
                values = micro_values(critic.model, placeholder_microbatch(mini).to(parallel.device), settings)
                (values.sum() * 0.0).backward()
                continue
            micro = micro.to(parallel.device)
            vpreds = micro_values(critic.model, micro, settings)
            per_token, clipped = compute_value_loss(vpreds, micro.values, micro.returns, micro.loss_mask,
                                                    critic.cfg.cliprange_value)
            loss = aggregate_loss(per_token, micro.loss_mask, "token-mean", global_tokens=tokens, global_seqs=1.0)
            (loss * parallel.loss_scale).backward()
            mini_loss += float(loss.detach())
            valid = micro.loss_mask.bool()
            sums += torch.tensor([float(clipped.sum()), float(vpreds.detach()[valid].sum()), float(valid.sum())],
                                 dtype=torch.float64)
        grad_norm, took = optimizer_step(critic.model, critic.optimizer, critic.scheduler, critic.cfg.grad_clip,
                                         losses_finite(mini_loss, parallel))
        loss_total += mini_loss
        grad_norms.append(grad_norm)
        stepped += took
    if parallel.dp_group is not None:  # each DP rank holds its rows' share; SP ranks of a group hold the same
        shares = all_reduce_sum(torch.tensor([loss_total, *sums.tolist()], dtype=torch.float64,
                                             device=parallel.device), parallel.dp_group).cpu()
        loss_total, sums = float(shares[0]), shares[1:]
    count = max(float(sums[2]), 1.0)
    minibatches_run = max(len(grad_norms), 1)
    return {
        "critic/vf_loss": loss_total / minibatches_run,
        "critic/vf_clipfrac": float(sums[0]) / count,
        "critic/vpred/mean": float(sums[1]) / count,
        "critic/grad_norm": sum(grad_norms) / minibatches_run,
        "critic/lr": critic.scheduler.get_last_lr()[0],
        "critic/skipped_minibatches": float(len(grad_norms) - stepped),
    }


def value_metrics(batch: Batch) -> dict:
    """What the step's advantages were measured against: the critic's values and returns on the trained tokens,
    and how much of the returns' variance the values explain (1 perfect, 0 no better than their mean)."""
    valid = batch.loss_mask.bool()
    count = max(int(valid.sum()), 1)
    return {
        "critic/values/mean": float(batch.values[valid].sum()) / count,
        "critic/returns/mean": float(batch.returns[valid].sum()) / count,
        "critic/explained_var": explained_variance(batch.values, batch.returns, batch.loss_mask),
    }
