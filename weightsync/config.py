"""Weight-sync settings (stdlib only)."""
from dataclasses import dataclass

BACKENDS = ("shm", "broadcast", "engine_push")
ENGINE_TRANSPORTS = ("nccl", "sparse_nccl", "ipc")


@dataclass
class WeightSyncConfig:
    backend: str = "shm"
    """Data plane for the steady fleet. `shm`: a persistent shared-memory mapping on the learner's host (generators
    elsewhere use the catch-up server). `broadcast`: also a torch.distributed group (gloo on CPU, NCCL on GPU) that
    relays each version along a chain of generators. `engine_push` (GPU learner, vLLM or SGLang generators, a GPU per
process): each version goes from the learner's GPU straight into every engine over NCCL, with vLLM's own NCCL
weight-transfer engine or SGLang's distributed update, one group per engine (weightsync/engine_push); generators
that miss a push load it from staging as with `shm`."""
    engine_transport: str = "nccl"
    """backend=engine_push, vLLM generators: which of vLLM's transfer engines carries a version. `nccl`: every
    version dense. `sparse_nccl`: only the elements that changed since the version the engine holds from the last
    push (bf16 weights keep most elements from one step to the next), dense when that is not smaller or the engine
    missed a push; keeps one more copy of the weights on the learner's GPU. `ipc`: CUDA IPC, for a vLLM engine on
    the learner's own GPU (one GPU for both; a one-rank learner). SGLang generators always take the dense NCCL
    path."""
    shm_dir: str = "/dev/shm"
    """Where the learner's ring and each generator's staging mapping live; tmpfs, for memory-speed copies."""
    keep_versions: int = 3
    """Versions the learner's ring holds at once (its slots), so a generator still copying one is not cut off."""
    dtype: str = "float32"
    """Dtype of the published weights (the engine's dtype); the cast happens once, on the learner."""
    bucket_mb: float = 64.0
    """Transfer bucket size, in MiB: tensors are packed into flat buckets of about this size, each checksummed and
    sent whole (bucket k travels while k+1 is gathered)."""
    host: str = "127.0.0.1"
    """Address every learner-side weight server binds to: the catch-up server, and with backend=broadcast or
    engine_push the rendezvous store (0.0.0.0 to serve generators on other hosts)."""
    catchup_port: int = 0
    """Port of the catch-up server (0: any free port; generators learn it from the weights announcement)."""
    advertise: str = ""
    """Host name generators on other machines use to reach the learner's weight servers ("" = weightsync.host)."""
    catchup_delta_max_fraction: float = 0.5
    """A generator holding an earlier version that the ring still has gets only the elements that changed since
    (weightsync/delta.py), unless that costs more than this fraction of the full version; 0: always full copies.
    Pays with bf16 or fp16 weights (dtype), where most elements keep their bits from step to step."""
    broadcast_port: int = 0
    """backend=broadcast or engine_push: port of the rendezvous store on the learner (0: any free port)."""
    timeout_s: float = 60.0
    """Longest any weight-sync wait may take (a fetch, a broadcast, a rendezvous) before it fails naming the peer."""
    every_steps: int = 1
    """Publish the weights every this many learner steps (and always after the last one). Between publishes the
    fleet keeps sampling with the last published version and admission stays at it, so staleness still never
    exceeds buffer.max_staleness; every_steps may be at most buffer.max_staleness + 1, or the fleet would run out of
    admissions while the learner waits for a batch. Larger values trade freshness for fewer transfers (big models,
    slow links)."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"weightsync.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.engine_transport not in ENGINE_TRANSPORTS:
            raise ValueError(f"weightsync.engine_transport must be one of {ENGINE_TRANSPORTS}, got "
                             f"{self.engine_transport!r}")
        if self.keep_versions < 2:
            raise ValueError(f"weightsync.keep_versions must be >= 2, got {self.keep_versions}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"weightsync.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0 <= self.catchup_delta_max_fraction <= 1:
            raise ValueError(f"weightsync.catchup_delta_max_fraction must be in [0, 1], got "
                             f"{self.catchup_delta_max_fraction}")
        if self.bucket_mb <= 0:
            raise ValueError(f"weightsync.bucket_mb must be > 0, got {self.bucket_mb}")
        for name in ("catchup_port", "broadcast_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"weightsync.{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ValueError(f"weightsync.timeout_s must be > 0, got {self.timeout_s}")
        if self.every_steps < 1:
            raise ValueError(f"weightsync.every_steps must be >= 1, got {self.every_steps}")
