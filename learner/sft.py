"""Supervised fine-tuning on the learner's own code (model loading, chunked logprobs, padded micro-batches).

Data: parquet in verl's row format. The prompt messages are rendered with the chat template; the target is
`reward_model.ground_truth` followed by EOS, and only target tokens carry loss.
"""
import logging
import os
import random

import torch

from asyncrl.learner.logprobs import compute_logprobs

log = logging.getLogger(__name__)


def read_sft_examples(paths: list, tokenizer) -> list[tuple[list, list]]:
    """(prompt_ids, target_ids) pairs from verl-format parquet rows."""
    import pyarrow.parquet as pq

    examples = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"SFT data file {path!r} does not exist")
        for row in pq.read_table(path).to_pylist():
            truth = (row.get("reward_model") or {}).get("ground_truth")
            if truth is None:
                raise ValueError(f"{path}: a row has no reward_model.ground_truth to use as the SFT target")
            text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            target = tokenizer(str(truth), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            examples.append((prompt, target))
    return examples


def pad_examples(examples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, L], attention_mask [B, L], loss_mask [B, L-1] (1 on target tokens)."""
    length = max(len(p) + len(t) for p, t in examples)
    input_ids = torch.zeros(len(examples), length, dtype=torch.long)
    attention = torch.zeros(len(examples), length, dtype=torch.long)
    loss_mask = torch.zeros(len(examples), length - 1)
    for row, (prompt, target) in enumerate(examples):
        ids = prompt + target
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        loss_mask[row, len(prompt) - 1 : len(ids) - 1] = 1
    return input_ids, attention, loss_mask


def run_sft(model, examples: list, steps: int, lr: float, batch_size: int, seed: int, chunk_tokens: int = 4096,
            on_step=None) -> list[float]:
    """Token-mean cross-entropy with AdamW; returns the loss of every step."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        input_ids, attention, loss_mask = pad_examples(rng.sample(examples, min(batch_size, len(examples))))
        ones = torch.ones(input_ids.shape[0])
        logprobs, _ = compute_logprobs(model, input_ids, attention, ones, chunk_tokens)
        loss = -(logprobs * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, steps, losses[-1])
    return losses
