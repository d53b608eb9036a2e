"""Weight-sync settings (stdlib only)."""
from dataclasses import dataclass

BACKENDS = ("shm",)


@dataclass
class WeightSyncConfig:
    backend: str = "shm"
    """Data plane. `shm`: safetensors files in a shared-memory directory on the learner's host."""
    shm_dir: str = "/dev/shm"
    """Parent directory of the per-job weight directory; must be tmpfs for speed and on the generators' host."""
    keep_versions: int = 3
    """Published versions kept on disk, so a generator still reading an old one is never cut off."""
    dtype: str = "float32"
    """Dtype of the published weights (the engine's dtype); the cast happens once, on the learner."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"weightsync.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.keep_versions < 2:
            raise ValueError(f"weightsync.keep_versions must be >= 2, got {self.keep_versions}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"weightsync.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
