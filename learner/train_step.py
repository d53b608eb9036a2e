"""One optimizer step of the learner, written as the algorithm reads (DESIGN.md §5).

compute_advantages -> build micro-batches -> forward_backward each (current logprobs at the sampling
temperature; π_prox; importance weight w = π_prox/π_behav; decoupled PPO; global-count aggregation) ->
optimizer_step. With one optimizer step per batch, π_prox is the policy at the start of the step, which is exactly
the current pass before any update, so its logprobs are the detached current ones: the separate no-grad recompute
pass would compute the same numbers and is skipped.
"""
import time

import torch

from asyncrl.algos.advantages import ADVANTAGES
from asyncrl.algos.corrections import compute_is_weight
from asyncrl.algos.losses import POLICY_LOSSES, aggregate_loss
from asyncrl.algos.metrics import combine_token_metrics, compute_offpolicy_metrics
from asyncrl.learner.batch import Batch, build_batch, split_microbatches
from asyncrl.learner.logprobs import compute_logprobs


def compute_advantages(groups: list, algo) -> torch.Tensor:
    """[num_groups, n] advantages from the groups' rewards."""
    rewards = torch.tensor([group.rewards() for group in groups], dtype=torch.float64)
    return ADVANTAGES[algo.advantage](rewards, norm_by_std=algo.norm_adv_by_std).float()


def forward_backward(model, micro: Batch, algo, chunk_tokens: int, global_tokens: float, global_seqs: float):
    """Loss of one micro-batch, scaled by the step's global counts, backpropagated. Returns detached pieces."""
    logprobs, entropy = compute_logprobs(model, micro.input_ids, micro.attention_mask, micro.temperatures,
                                         chunk_tokens, with_entropy=True)  # [b, l-1]
    logprobs_prox = logprobs.detach()
    is_weight, correction_metrics = compute_is_weight(
        logprobs_prox, micro.logprobs_behav, micro.loss_mask,
        correction=algo.correction, cap=algo.is_cap, mode=algo.is_mode)
    per_token, loss_metrics = POLICY_LOSSES[algo.loss](
        logprobs, logprobs_prox, micro.advantages, micro.loss_mask,
        clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip_c=algo.dual_clip_c, is_weight=is_weight)
    loss = aggregate_loss(per_token, micro.loss_mask, algo.loss_agg, global_tokens=global_tokens,
                          global_seqs=global_seqs, norm_constant=algo.loss_norm_constant)
    loss.backward()
    valid = micro.loss_mask.bool()
    return loss.detach(), {**loss_metrics, **correction_metrics}, logprobs_prox[valid], entropy[valid]


def optimizer_step(model, optimizer, scheduler, grad_clip: float) -> float:
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def train_step(model, optimizer, scheduler, groups: list, algo, max_tokens_per_microbatch: int,
               chunk_tokens: int, grad_clip: float) -> dict:
    started = time.perf_counter()
    advantages = compute_advantages(groups, algo)
    batch = build_batch(groups, advantages)
    global_tokens = float(batch.loss_mask.sum())
    global_seqs = float((batch.loss_mask.sum(-1) > 0).sum())
    total_loss, token_metrics, prox, behav, entropies = 0.0, [], [], [], []
    for micro in split_microbatches(batch, max_tokens_per_microbatch):
        loss, metrics, micro_prox, micro_entropy = forward_backward(
            model, micro, algo, chunk_tokens, global_tokens, global_seqs)
        total_loss += float(loss)
        token_metrics.append(metrics)
        prox.append(micro_prox)
        behav.append(micro.logprobs_behav[micro.loss_mask.bool()])
        entropies.append(micro_entropy)
    grad_norm = optimizer_step(model, optimizer, scheduler, grad_clip)
    prox, behav = torch.cat(prox), torch.cat(behav)
    rewards = torch.tensor([r for group in groups for r in group.rewards()])
    group_std = torch.tensor([torch.tensor(group.rewards()).std().item() if len(group.samples) > 1 else 0.0
                              for group in groups])
    step_s = time.perf_counter() - started
    return {
        "loss/pg": total_loss,
        "loss/total": total_loss,
        **combine_token_metrics(token_metrics),
        **compute_offpolicy_metrics(prox, behav, torch.ones_like(prox)),
        "policy/entropy": float(torch.cat(entropies).mean()) if global_tokens else 0.0,
        "policy/grad_norm": grad_norm,
        "policy/lr": scheduler.get_last_lr()[0],
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/frac_zero_std_groups": float((group_std == 0).float().mean()),
        "rollout/len_tokens/mean": global_tokens / max(rewards.numel(), 1),
        "timing/learner/step_s": step_s,
        "perf/learner/tokens_per_s": float(batch.attention_mask.sum()) / step_s,
    }
