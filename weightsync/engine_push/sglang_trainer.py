"""The learner's side of SGLang's distributed weight update, for the engine push (sender.py).

SGLang has no trainer-side engine like vLLM's, only the two calls its RL docs pair with a torch.distributed group
that the trainer opens as rank 0: `init_weights_update_group(master_address, master_port, rank_offset, world_size,
group_name, backend)` on the engine, while the trainer joins the same rendezvous; then per version
`update_weights_from_distributed(names, dtypes, shapes, group_name, ...)` on the engine, while the trainer
broadcasts each tensor from rank 0 in `names` order. `SglangTrainer` runs that with the control flow of vLLM's
`NCCLTrainerWeightTransferEngine` (the engine's init on a side thread while the group opens; start, update on a
side thread while broadcasting, finish), so sender.py drives both the same way and its watchdog covers both.

Rank 0 is opened with SGLang's own `init_custom_process_group` (what its workers use for the other ranks), so the
two ends rendezvous the same way by construction; the learner then needs `sglang` importable. CPU tests pass
`open_group` with a gloo stand-in (tests/fakes/fake_sglang.py `join_weights_group`).
"""
from concurrent.futures import ThreadPoolExecutor

import torch

from asyncrl.weightsync.broadcast.chain import abort_process_group


def sglang_rank0(master_address: str, master_port: int, world_size: int, group_name: str, backend: str):
    """Rank 0 of SGLang's weight-update group, through SGLang's own rendezvous helper."""
    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError as err:
        raise RuntimeError(f"weightsync.backend=engine_push with SGLang generators opens SGLang's weight-update "
                           f"group on the learner, and sglang cannot be imported here ({err}); install the `gpu` "
                           f"extra on the learner too") from None
    return init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                     world_size=world_size, rank=0, group_name=group_name)


class SglangTrainer:
    def __init__(self, master_address: str, master_port: int, world_size: int, client, source,
                 open_group=sglang_rank0, backend: str = "nccl"):
        self.client, self.source = client, source
        self.group_name = f"asyncrl-weights-{master_port}"
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, {
                "master_address": master_address, "master_port": master_port, "rank_offset": 1,
                "world_size": world_size, "group_name": self.group_name, "backend": backend})
            self.group = open_group(master_address, master_port, world_size, self.group_name, backend)
            future.result()

    def send_weights(self) -> None:
        meta = self.source.metadata()
        update_info = {"names": [m.name for m in meta], "dtypes": [str(m.dtype).split(".")[-1] for m in meta],
                       "shapes": [list(m.shape) for m in meta], "group_name": self.group_name,
                       "weight_version": str(self.client.version)}
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, update_info)
            # the group's own broadcast: works for SGLang's registered group and for a plain ProcessGroup alike
            works = [self.group.broadcast(tensor, 0) for _, tensor in self.source]
            for work in works:
                work.wait()
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
            future.result()
        finally:
            exe.shutdown(wait=False)  # never join a thread that may be stuck in the engine's receive
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        abort_process_group(self.group)
