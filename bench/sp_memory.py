"""Activation memory of one rank for one long sequence, at SP = 1 and SP = 2 (Ulysses over gloo).

"Activation memory" is what autograd keeps for backward: the bytes of every distinct tensor storage saved during
the forward (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded. On CPU there is no allocator
counter to read, and this is the quantity sequence parallelism divides: each SP rank keeps its slice of the
sequence, and attention keeps the whole sequence for its share of the heads. The process's peak RSS is reported
beside it, but it also holds the model, the interpreter and torch itself.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.model import build_qwen2
from asyncrl.learner.ulysses import apply_ulysses

VOCAB = 512


def saved_activation_bytes(model, input_ids: torch.Tensor, sp_group) -> int:
    """Forward (logprobs of the whole sequence) counting saved-for-backward storages; then backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = compute_logprobs(model, input_ids, torch.ones_like(input_ids), torch.ones(1), chunk_tokens=1024,
                                       sp_group=sp_group)
    logprobs.sum().backward()
    return sum(seen.values())


def peak_rss_bytes() -> int:
    """VmHWM of this process. (ru_maxrss would not do: it survives exec, so a spawned rank reports its parent's.)"""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rank_worker(rank: int, world: int, port: int, seq_len: int, hidden: int, layers: int, out: str) -> None:
    torch.set_num_threads(1)
    sp_group = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        sp_group = dist.group.WORLD
    model = build_qwen2(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, eos_token_id=1, pad_token_id=0,
                        seed=0).train()
    model.config.max_position_embeddings = seq_len
    if sp_group is not None:
        apply_ulysses(model, sp_group, world)
    input_ids = torch.randint(2, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(0))
    activations = saved_activation_bytes(model, input_ids, sp_group)
    peak_rss = peak_rss_bytes()
    with open(f"{out}.{rank}", "w") as handle:
        handle.write(f"{activations} {peak_rss}")
    if world > 1:
        dist.barrier()  # both ranks leave together: tearing gloo down while a peer still talks can abort
        dist.destroy_process_group()
        # and the rank skips interpreter finalization, where gloo's leftover threads can still abort the process
        # ("terminate called without an active exception", seen once in CI after the result was written)
        os._exit(0)


def measure_sp_memory(seq_len: int, hidden: int, layers: int, port_for) -> dict:
    """{sp: {"activation_bytes": rank 0's, "peak_rss_bytes": rank 0's}} for sp in (1, 2)."""
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sp in (1, 2):
            out = os.path.join(tmp, f"sp{sp}")
            mp.start_processes(rank_worker, args=(sp, port_for(), seq_len, hidden, layers, out), nprocs=sp,
                               start_method="spawn", join=True)
            with open(f"{out}.0") as handle:
                activations, rss = (int(x) for x in handle.read().split())
            result[sp] = {"activation_bytes": activations, "peak_rss_bytes": rss}
    return result
