"""Supervised fine-tuning on the learner's own stack: the same micro-batch planner (token budget, balanced over
data-parallel ranks), the same chunked logprobs (padded or packed, Ulysses when sp_size > 1) and FSDP2.

Data comes from `asyncrl.data.sft` (chat parquet with a loss mask on assistant turns, or verl rows). The loss is the
token-mean cross-entropy over every trained token of the step: each micro-batch's sum is divided by the step's
total trained tokens, so the split into micro-batches and ranks does not change it.
"""
import logging
import random

import numpy as np
import torch

from asyncrl.learner.batch import Batch, placeholder_microbatch
from asyncrl.learner.train_step import StepSettings

log = logging.getLogger(__name__)


def sft_batch(examples: list) -> Batch:
    """Right-padded rows of `SFTExample`s as a learner Batch. loss_mask[:, t] says whether token t+1 is trained
    (logprob positions predict the next token); the RL-only fields are zeros."""
    length = max(len(example.input_ids) for example in examples)
    rows = len(examples)
    input_ids = np.zeros((rows, length), dtype=np.int64)
    attention = np.zeros((rows, length), dtype=np.int64)
    loss_mask = np.zeros((rows, length - 1), dtype=np.float32)
    for row, example in enumerate(examples):
        size = len(example.input_ids)
        input_ids[row, :size] = example.input_ids
        attention[row, :size] = 1
        loss_mask[row, : size - 1] = example.loss_mask[1:]
    zeros = torch.zeros(rows, length - 1)
    return Batch(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention),
                 loss_mask=torch.from_numpy(loss_mask), logprobs_behav=zeros, versions=zeros.long(),
                 token_rewards=zeros, temperatures=torch.ones(rows), rows=torch.arange(rows))


def sft_step(model, optimizer, examples: list, settings: StepSettings) -> float:
    """One optimizer step on `examples` (the same list on every rank); returns the step's mean token loss."""
    batch = sft_batch(examples)
    tokens = float(batch.loss_mask.sum())
    if tokens == 0:
        raise ValueError("an SFT batch has no trained tokens (every loss mask is empty)")
    total = 0.0
    for micro in settings.microbatches(batch):
        if micro is None:
            micro = placeholder_microbatch(batch)
            micro.loss_mask = torch.zeros_like(micro.loss_mask)  # runs the model for FSDP; contributes nothing
        micro = micro.to(settings.parallel.device)
        logprobs, _ = settings.logprobs(model, micro)
        loss = -(logprobs * micro.loss_mask).sum() / tokens
        (loss * settings.parallel.loss_scale).backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip if settings.grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if settings.parallel.dp_group is not None:  # each DP rank summed its own rows
        box = torch.tensor([total], dtype=torch.float64, device=settings.parallel.device)
        torch.distributed.all_reduce(box, group=settings.parallel.dp_group)
        total = float(box)
    return total


@torch.no_grad()
def sft_eval_loss(model, examples: list, settings: StepSettings, batch_size: int) -> float:
    """The token-mean cross-entropy of `examples` (a validation split), in batches of `batch_size`, every rank
    running the same passes (placeholders where it has no rows) and the sums reduced over data-parallel ranks."""
    total = torch.zeros(2, dtype=torch.float64, device=settings.parallel.device)  # [NLL sum, tokens]
    was_training = model.training
    model.eval()
    for start in range(0, len(examples), batch_size):
        batch = sft_batch(examples[start:start + batch_size])
        for micro in settings.microbatches(batch):
            if micro is None:
                micro = placeholder_microbatch(batch)
                micro.loss_mask = torch.zeros_like(micro.loss_mask)
            micro = micro.to(settings.parallel.device)
            logprobs, _ = settings.logprobs(model, micro)
            total += torch.stack([-(logprobs * micro.loss_mask).sum(), micro.loss_mask.sum()]).double()
    if was_training:
        model.train()
    if settings.parallel.dp_group is not None:
        torch.distributed.all_reduce(total, group=settings.parallel.dp_group)
    return float(total[0] / total[1].clamp(min=1))


def epoch_batches(count: int, batch_size: int, epoch: int, seed: int) -> list:
    """The batches of one epoch: a seeded shuffle of the `count` examples (the same for the same seed and epoch,
    so a resumed job walks the same order), cut into consecutive batches; the last may be smaller."""
    order = list(range(count))
    random.Random(f"sft:{seed}:{epoch}").shuffle(order)
    return [order[start:start + batch_size] for start in range(0, count, batch_size)]


def batch_for_step(step: int, count: int, batch_size: int, seed: int, epochs: int) -> tuple[int, list]:
    """(epoch, example indexes) of optimizer step `step` (0-based): with `epochs` > 0 the epochs' batches in
    order, each example once per epoch; with 0, a sample of batch_size seeded by the step (steps mode). A pure
    function of the step, so a job resumed at step s draws exactly what the uninterrupted one would have."""
    if epochs <= 0:
        return 0, random.Random(f"sft:{seed}:step:{step}").sample(range(count), min(batch_size, count))
    per_epoch = -(-count // batch_size)
    epoch = step // per_epoch
    return epoch, epoch_batches(count, batch_size, epoch, seed)[step % per_epoch]


def run_sft(model, examples: list, steps: int, lr: float, batch_size: int, seed: int,
            settings: StepSettings | None = None, on_step=None) -> list[float]:
    """AdamW over `steps` batches of `batch_size` examples drawn with `seed` (identically on every rank); returns
    the loss of every step."""
    if not examples:
        raise ValueError("no SFT examples to train on")
    settings = settings or StepSettings(version=0, max_staleness=0, max_tokens_per_microbatch=1 << 30,
                                        chunk_tokens=4096, grad_clip=1.0)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        losses.append(sft_step(model, optimizer, rng.sample(examples, min(batch_size, len(examples))), settings))
        if on_step is not None:
            on_step(step + 1, steps, losses[-1])
    return losses
