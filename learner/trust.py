"""Per-generator trust: the sampler/learner logprob mismatch of each generator's trained groups, and the quarantine
of a generator whose logprobs the learner cannot have produced.

Why: every logprob a generator sends is trusted by the loss (the importance ratio π/μ, the clipping, the
corrections all read ℓμ), and no check on the group alone can tell a made-up logprob from a real one: -0.01 on
every token is a valid number. Only the learner, which computes its own logprob of every trained token anyway
(learner/train_step.py), can compare. Each generator's last `window_groups` trained groups are kept as
(Σ |ℓlearner - ℓμ|, tokens); once the window is full and the token mean exceeds `threshold_nats`, the generator is
quarantined for the rest of the job: its further groups are refused in `collect_batch`
(buffer/rejected/quarantined, with zmq the generator hears it in its next reply), and the log says which and why.

The threshold is a mean over many tokens of many groups, in nats: 1.0 means the generator's probabilities are
off by a factor e on the average token. What honest engines show is far below it: bf16 inference against an
fp32/bf16 learner gives 0.005-0.05 (slime's train_rollout_logprob_abs_diff; NeMo-RL alerts at a mean probability
error of 5 %, i.e. 0.05 nats), MoE routing flips and fp8 rollouts 0.05-0.2, and the policy's own drift over η
steps of staleness adds at most a few hundredths at sane learning rates. A generator past 1.0 sends logprobs no
engine of this model produced (made up, another model, another temperature): its importance ratios are noise.
The window keeps one odd group (a very long completion at high temperature) from deciding alone. The quarantine
is keyed by generator id, so a restarted generator stays quarantined, and it is saved with the learner's
checkpoint (learner/state.py), so a resumed learner keeps it (when it did not, the hour soak's liar had 22 and 28
of its 32 groups trained over four learner restarts, a new window after each). A resumed learner measures every
other generator's mismatch afresh.
"""
import logging
import math
from collections import deque

log = logging.getLogger(__name__)

QUARANTINE_HINT = ("If those generators are honest engines of this model, the policy itself moved between the version "
                   "they sampled and the one trained by more than learner.quarantine_abs_diff nats a token, which the "
                   "quarantine cannot tell from made-up logprobs: a learning rate too high for buffer.max_staleness "
                   "(lower learner.lr or the staleness, or raise learner.quarantine_abs_diff)")
"""What a wait that only quarantined generators could fill says, and the log line of a quarantine that leaves no
generator the learner trusts: with one honest generator whose policy diverges (seen at lr 1e-3 on the vision demo)
the learner otherwise waited out learner.wait_for_batch_timeout_s with nothing in the log but the quarantine."""


class GeneratorTrust:
    """Rank 0's ledger of each generator's recent mismatch, and the generators it quarantined. Used by the
    learner's thread only (noted after each trained step, asked in collect_batch)."""

    def __init__(self, threshold_nats: float, window_groups: int, quarantined: dict | None = None):
        """`threshold_nats` 0: never quarantine (the mismatch is still measured and named in warnings);
        `quarantined`: those of a checkpoint (generator -> why), still refused."""
        self.threshold_nats = threshold_nats
        self.window_groups = window_groups
        self._recent: dict[str, deque] = {}  # generator -> its last window_groups (Σ|Δ|, tokens)
        self.quarantined: dict[str, str] = dict(quarantined or {})  # generator -> why, as its refusals say it

    def note(self, groups: list, group_abs_diff: list, step: int) -> list[str]:
        """Record a trained step's groups ((Σ|Δ|, tokens) each, in the batch's order); returns the generators it
        quarantined now, each logged with its figures."""
        for group, (total, tokens) in zip(groups, group_abs_diff):
            if tokens > 0 and math.isfinite(total):
                self._recent.setdefault(group.generator_id, deque(maxlen=self.window_groups)).append((total, tokens))
        newly = []
        for gen in sorted({group.generator_id for group in groups}):
            mean = self.mean(gen)
            if (self.threshold_nats > 0 and gen not in self.quarantined and mean is not None
                    and mean > self.threshold_nats and len(self._recent[gen]) >= self.window_groups):
                self.quarantined[gen] = (f"generator {gen!r} is quarantined: mean |behaviour - learner logprob| = "
                                         f"{mean:.3f} nats over its last {self.window_groups} trained groups, above "
                                         f"learner.quarantine_abs_diff={self.threshold_nats:g} at step {step}")
                log.error("learner: %s; its logprobs are not the model's (made up, another model or another "
                          "temperature): its further groups are refused (buffer/rejected/quarantined)",
                          self.quarantined[gen])
                newly.append(gen)
        if newly and all(gen in self.quarantined for gen in self._recent):
            log.error("learner: every generator whose groups were trained is quarantined (%s): no batch can fill until "
                      "another one connects. %s", ", ".join(sorted(self._recent)), QUARANTINE_HINT)
        return newly

    def mean(self, gen: str) -> float | None:
        """The token mean of |ℓlearner - ℓμ| over the generator's recent groups, None before any."""
        recent = self._recent.get(gen)
        tokens = sum(count for _, count in recent) if recent else 0
        return sum(total for total, _ in recent) / tokens if tokens else None

    def per_generator(self, groups: list, group_abs_diff: list) -> dict[str, float]:
        """Each generator's token mean of |ℓlearner - ℓμ| in one step's groups (for its warning line)."""
        sums: dict[str, tuple[float, int]] = {}
        for group, (total, tokens) in zip(groups, group_abs_diff):
            done, count = sums.get(group.generator_id, (0.0, 0))
            sums[group.generator_id] = (done + total, count + tokens)
        return {gen: total / count for gen, (total, count) in sorted(sums.items()) if count}

    def refusal(self, group) -> str | None:
        """Why `group` must not be trained (its generator is quarantined), or None."""
        return self.quarantined.get(group.generator_id)

    def metrics(self) -> dict:
        return {"learner/quarantined_generators": float(len(self.quarantined))}
