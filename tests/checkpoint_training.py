"""A tiny model, optimizer and scheduler, and a few training steps whose losses depend on the torch, python and numpy
RNGs: a checkpoint resumes exactly only if it restores all of them."""
import random

import numpy as np
import torch

from asyncrl.learner.build import build_optimizer
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.model import build_qwen2


VOCAB = 64


def build_training(seed: int = 0):
    model = build_qwen2(vocab_size=VOCAB, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0, seed=seed)
    optimizer, scheduler = build_optimizer(model, LearnerConfig(warmup_steps=10))  # lr changes every step
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, steps: int) -> list[float]:
    """A toy LM loss on inputs drawn from torch's RNG, weighted by python and numpy draws: resuming is only exact
    when all three RNG states come back."""
    losses = []
    for _ in range(steps):
        ids = torch.randint(2, VOCAB, (2, 12))
        weight = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        loss = model(input_ids=ids, labels=ids).loss * weight
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
