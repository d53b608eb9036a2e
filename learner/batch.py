"""Turning groups into padded tensors and splitting them into token-budget micro-batches.

Every tensor that describes completion tokens is aligned with the learner's logprobs: position t of a [B, L-1]
tensor is the token at input position t+1. Prompt positions and padding have loss_mask 0.
"""
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L-1] float32
    logprobs_behav: torch.Tensor  # [B, L-1] float32 (generator logprobs, 0 where masked)
    versions: torch.Tensor  # [B, L-1] int64 (-1 where masked)
    advantages: torch.Tensor  # [B, L-1] float32 (the sequence's advantage on its tokens)
    temperatures: torch.Tensor  # [B] float32

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "Batch":
        """The given rows, trimmed to their longest sequence (micro-batches carry no extra padding)."""
        length = int(self.attention_mask[rows].sum(-1).max())
        return Batch(
            input_ids=self.input_ids[rows, :length],
            attention_mask=self.attention_mask[rows, :length],
            loss_mask=self.loss_mask[rows, : length - 1],
            logprobs_behav=self.logprobs_behav[rows, : length - 1],
            versions=self.versions[rows, : length - 1],
            advantages=self.advantages[rows, : length - 1],
            temperatures=self.temperatures[rows],
        )


def build_batch(groups: list, advantages: torch.Tensor) -> Batch:
    """One row per sample, in group order. `advantages` is [num_groups, n] (one value per sample)."""
    rows = [(group, sample, advantages[g, s]) for g, group in enumerate(groups) for s, sample in enumerate(group.samples)]
    length = max(len(group.prompt_ids) + len(sample.completion_ids) for group, sample, _ in rows)
    batch = len(rows)
    input_ids = np.zeros((batch, length), dtype=np.int64)
    attention_mask = np.zeros((batch, length), dtype=np.int64)
    loss_mask = np.zeros((batch, length - 1), dtype=np.float32)
    behav = np.zeros((batch, length - 1), dtype=np.float32)
    versions = np.full((batch, length - 1), -1, dtype=np.int64)
    adv = np.zeros((batch, length - 1), dtype=np.float32)
    temps = np.zeros(batch, dtype=np.float32)
    for row, (group, sample, advantage) in enumerate(rows):
        prompt_len, comp_len = len(group.prompt_ids), len(sample.completion_ids)
        input_ids[row, :prompt_len] = group.prompt_ids
        input_ids[row, prompt_len : prompt_len + comp_len] = sample.completion_ids
        attention_mask[row, : prompt_len + comp_len] = 1
        span = slice(prompt_len - 1, prompt_len - 1 + comp_len)
        loss_mask[row, span] = 1.0 if sample.loss_mask is None else sample.loss_mask
        behav[row, span] = sample.logprobs
        versions[row, span] = sample.versions
        adv[row, span] = float(advantage)
        temps[row] = group.sampling.temperature
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        loss_mask=torch.from_numpy(loss_mask),
        logprobs_behav=torch.from_numpy(behav),
        versions=torch.from_numpy(versions),
        advantages=torch.from_numpy(adv),
        temperatures=torch.from_numpy(temps),
    )


def split_microbatches(batch: Batch, max_tokens: int) -> list[Batch]:
    """Rows sorted by length, packed greedily so rows x longest row stays within `max_tokens` per micro-batch."""
    lengths = batch.attention_mask.sum(-1)
    order = torch.argsort(lengths, descending=True)
    micro, current = [], []
    for row in order.tolist():
        longest = int(lengths[current[0]]) if current else int(lengths[row])
        if current and (len(current) + 1) * longest > max_tokens:
            micro.append(batch.select(torch.tensor(current)))
            current = []
        current.append(row)
    if current:
        micro.append(batch.select(torch.tensor(current)))
    return micro
