"""A tiny batch for the algorithm tests (tests/unit/test_algos.py, test_losses.py): free logits z [B, T, V] stand
in for a model, so gradients are exact and cheap."""
import torch

F64 = torch.float64
LENGTHS = [1, 6, 3, 0, 5, 4, 6, 2]  # unequal, and one sequence with no trainable token
B, T, V = len(LENGTHS), 6, 5


def make_batch(seed=0):
    """A tiny "model" (free logits z [B, T, V]) plus sampled tokens, mask and per-sequence advantages."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=gen, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).to(F64)  # [B, T]
    advantages = torch.randn(B, 1, generator=gen, dtype=F64).expand(B, T).contiguous()  # per sequence
    noise = 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    return z, tokens, mask, advantages, noise


def token_logprobs(z, tokens):
    return torch.log_softmax(z, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)  # [B, T]


def counts(mask):
    return dict(global_tokens=float(mask.sum()), global_seqs=float((mask.sum(-1) > 0).sum()), norm_constant=4.0)
