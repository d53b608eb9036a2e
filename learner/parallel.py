"""The learner's ranks: process group, device mesh (dp × sp), FSDP2 and the collectives the train step needs.

Rank r sits at (dp = r // sp_size, sp = r % sp_size). Ranks of one SP group see the same rows and split each
sequence; DP groups see different rows. FSDP2 shards parameters over all ranks (a 1-D mesh of the world): SP ranks
hold different activations of the same parameters, so they are data parallel as far as gradients are concerned.
FSDP averages gradients over the world, so every rank scales its loss by the world size (`loss_scale`) and the
sum of the ranks' local losses, each normalised by the step's global counts, is the step's loss. (Gloo has no
PREMUL_SUM, so FSDP's divide factor cannot be changed instead.)

One process with no torchrun environment gets a ParallelState of size 1 and no process group: nothing here then
calls torch.distributed, so the single-process learner is exactly the code path it always was.
"""
import datetime
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.weightsync.dtypes import DTYPES

log = logging.getLogger(__name__)


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    dp_group: Any = None
    """Ranks with the same sp_rank (different rows)."""
    sp_group: Any = None
    """Ranks with the same dp_rank (one sequence split between them)."""
    fsdp_mesh: Any = None
    """1-D DeviceMesh over the world, which FSDP2 shards over."""
    device: str = "cpu"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def loss_scale(self) -> float:
        """Multiplies each rank's loss, undoing FSDP's average over the world."""
        return float(self.world_size)


class ParallelConfigError(ValueError):
    """The launch does not fit learner.sp_size (or the environment is half set up)."""


def init_parallel(sp_size: int, timeout_s: float = 600.0) -> ParallelState:
    """Join torchrun's process group (env:// rendezvous) and build the meshes; a plain process gets size 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        if sp_size != 1:
            raise ParallelConfigError(f"learner.sp_size={sp_size} needs {sp_size}·k ranks, but this is one process; "
                                      f"launch with `asyncrl learner --nproc {sp_size}` or torchrun")
        return ParallelState(device="cuda" if torch.cuda.is_available() else "cpu")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return build_parallel_state(sp_size, device)


def build_parallel_state(sp_size: int, device: str = "cpu") -> ParallelState:
    """The meshes for an initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if sp_size < 1 or world % sp_size:
        raise ParallelConfigError(f"learner.sp_size={sp_size} must divide the number of ranks ({world})")
    dp_size = world // sp_size
    mesh = init_device_mesh(device, (dp_size, sp_size), mesh_dim_names=("dp", "sp"))
    fsdp_mesh = init_device_mesh(device, (world,), mesh_dim_names=("fsdp",))
    return ParallelState(rank=rank, world_size=world, dp_rank=rank // sp_size, dp_size=dp_size,
                         sp_rank=rank % sp_size, sp_size=sp_size, dp_group=mesh.get_group("dp"),
                         sp_group=mesh.get_group("sp"), fsdp_mesh=fsdp_mesh, device=device)


def decoder_layers(model) -> list:
    """The transformer blocks of an HF causal LM (`model.model.layers` for Llama/Qwen/Gemma families)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ParallelConfigError(f"{type(model).__name__} has no decoder .layers to shard one by one")
    return list(layers)


def apply_fsdp(model, parallel: ParallelState, param_dtype: str = "float32", reduce_dtype: str = "float32",
               cpu_offload: bool = False, activation_checkpointing: bool = False):
    """fully_shard each decoder layer, then the root (embeddings, final norm, head), with a MixedPrecisionPolicy.
    Each layer is its own all-gather/reduce-scatter unit, so only one layer's full parameters exist at a time."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if activation_checkpointing:
        # HF's own switch: each decoder layer re-runs its forward in backward instead of keeping activations.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not parallel.distributed:
        return model
    if cpu_offload and parallel.device == "cpu":
        raise ParallelConfigError("learner.cpu_offload moves sharded parameters from GPU to host memory; on a CPU "
                                  "learner they already live there, so turn it off")
    # decoder_states returns out.hidden_states[-1], a view; nothing modifies it in place, which is what this warns of
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=True) if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=parallel.fsdp_mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=parallel.fsdp_mesh, mp_policy=policy, offload_policy=offload)
    return model


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over `group` (no-op without a process group)."""
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_objects(obj, group) -> list:
    """Every rank's `obj`, in rank order within `group` (just [obj] without a process group)."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, parallel: ParallelState):
    """Rank 0's `obj` on every rank."""
    if not parallel.distributed:
        return obj
    box = [obj if parallel.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
