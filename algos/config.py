"""Algorithm choices (stdlib only). The names match the registries in `asyncrl.algos`."""
from dataclasses import dataclass
from typing import Optional

ADVANTAGE_NAMES = ("grpo",)
LOSS_NAMES = ("ppo",)
CORRECTION_NAMES = ("none", "decoupled")
LOSS_AGG_NAMES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass
class AlgoConfig:
    advantage: str = "grpo"
    """Advantage estimator."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's std (False gives Dr.GRPO)."""
    loss: str = "ppo"
    """Policy loss."""
    clip_low: float = 0.2
    """PPO lower clip ε_low: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO upper clip ε_high (clip-higher): the ratio is clipped at 1 + clip_high."""
    dual_clip_c: Optional[float] = None
    """Dual-clip bound c > 1 for negative advantages; None disables it."""
    correction: str = "decoupled"
    """Off-policy correction: `decoupled` (w = π_prox/π_behav, AReaL) or `none`."""
    is_cap: float = 5.0
    """Upper bound on the decoupled importance weight w."""
    is_mode: str = "truncate"
    """What happens above is_cap: `truncate` (w = min(w, cap)) or `mask` (the token gets weight 0)."""
    loss_agg: str = "token-mean"
    """Loss aggregation; normalisers are global over the optimizer step."""
    loss_norm_constant: Optional[float] = None
    """Constant divisor for seq-mean-token-sum-norm (Dr.GRPO), e.g. the max completion length."""

    def __post_init__(self):
        for key, value, allowed in (
            ("advantage", self.advantage, ADVANTAGE_NAMES),
            ("loss", self.loss, LOSS_NAMES),
            ("correction", self.correction, CORRECTION_NAMES),
            ("loss_agg", self.loss_agg, LOSS_AGG_NAMES),
            ("is_mode", self.is_mode, ("truncate", "mask")),
        ):
            if value not in allowed:
                raise ValueError(f"algo.{key} must be one of {allowed}, got {value!r}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"algo.clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"algo.clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"algo.dual_clip_c must be > 1 or null, got {self.dual_clip_c}")
        if self.is_cap <= 1:
            raise ValueError(f"algo.is_cap must be > 1, got {self.is_cap}")
        if self.loss_agg == "seq-mean-token-sum-norm" and not self.loss_norm_constant:
            raise ValueError("algo.loss_norm_constant must be set (> 0) when algo.loss_agg=seq-mean-token-sum-norm")
