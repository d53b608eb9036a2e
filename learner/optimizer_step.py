"""Taking an optimizer step only when every rank's loss and the global gradient norm are finite: shared by the
policy (learner/train_step.py), the critic (learner/critic.py) and PRIME's PRM (learner/prm.py)."""
import math

import torch
import torch.distributed as dist

from asyncrl.learner.parallel import ParallelState


def losses_finite(loss: float, parallel: ParallelState) -> bool:
    """Whether every rank's loss for this mini-batch is finite: a flag summed over the world, so all ranks agree
    (each holds other rows, and one rank stepping while another does not would split the shards' history)."""
    bad = torch.tensor([0.0 if math.isfinite(loss) else 1.0], device=parallel.device)
    if parallel.distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.SUM)
    return float(bad) == 0.0


def optimizer_step(model, optimizer, scheduler, grad_clip: float, loss_finite: bool = True) -> tuple[float, bool]:
    """(the global gradient norm, whether the step was taken). A non-finite loss or norm (a NaN or inf anywhere in
    the gradients, on any rank: the norm is global, so every rank decides alike) drops the gradients instead:
    clipping cannot repair a NaN, one NaN step makes every weight NaN, then every published version, and an inf
    loss whose gradient happens to be finite (an underflowed ratio) still says the batch is out of range."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    finite = loss_finite and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite
