"""`LearnerState`: what a learner step needs besides the model and the optimizer, and what a checkpoint keeps
besides them. One object, saved and loaded whole (learner/checkpoint.py writes it into meta.json), so a resumed
learner continues with the same version, frontier, counters and KL coefficient, and nothing it knew is lost.

`AckLedger` decides when the buffer may forget the groups the learner trained: only once a checkpoint covering
their step is on disk (see its docstring).
"""
from collections import Counter
from dataclasses import dataclass, field

STATE_FORMAT = 1
"""Version of `to_json`'s layout; `from_json` refuses layouts it does not know."""


@dataclass
class LearnerState:
    version: int = 0
    """Optimizer steps done (= the version of the weights the next step trains)."""
    groups_consumed: int = 0
    """Groups trained since the job started (dropped ones are counted in `dropped_total`)."""
    groups_by_generator: dict = field(default_factory=dict)
    """generator id -> groups of it trained: the consumed frontier per generator."""
    dropped_total: Counter = field(default_factory=Counter)
    """reason -> groups taken but not trained (stale, zero_variance, no_baseline, empty, poisoned_step)."""
    unacked: list = field(default_factory=list)
    """Buffer receipts (Redis stream entries) of groups taken since the last checkpoint: a checkpoint lists them, and
    the buffer forgets them once that checkpoint is on disk (`AckLedger`)."""
    kl_coef: float | None = None
    """The reward-KL controller's coefficient β (None: no controller state to keep). The adaptive controller moves
    it every step; without it in the checkpoint a resumed run would start again from algo.kl_reward_coef."""
    skipped_steps: int = 0
    """Steps skipped because their batch poisoned them (a non-finite gradient, or a batch that could not be built):
    the version did not move for them."""
    skipped_in_a_row: int = 0
    """Of those, how many in a row up to now (learner.max_consecutive_skips stops the job)."""
    checkpoint_failures: int = 0
    """Checkpoints that could not be written (a full or read-only disk): training went on without them."""
    data_cursor: dict = field(default_factory=dict)
    """The prompt dealer's cursor (buffer/dealing.py `snapshot`): the epoch, how far it was dealt, the prompts to
    deal again; empty for a job without dealt data. Saved and restored like the rest."""
    quarantined: dict = field(default_factory=dict)
    """generator id -> why it is quarantined (learner/trust.py): a resumed learner keeps refusing its groups."""
    mlflow_run_id: str = ""
    """The job's MLflow run: a resumed learner goes on logging into it (one run per job, not one per life)."""

    def record_batch(self, groups: list, dropped: dict) -> None:
        """A batch was trained on `groups`; `dropped` (reason -> count) were dropped while assembling it."""
        self.groups_consumed += len(groups)
        for group in groups:
            self.groups_by_generator[group.generator_id] = self.groups_by_generator.get(group.generator_id, 0) + 1
        self.dropped_total.update(dropped)

    def to_json(self) -> dict:
        """A JSON-able copy (the checkpoint keeps this, so later changes to the state do not reach it)."""
        return {"format": STATE_FORMAT, "version": self.version, "groups_consumed": self.groups_consumed,
                "groups_by_generator": dict(self.groups_by_generator), "dropped_total": dict(self.dropped_total),
                "unacked": list(self.unacked), "kl_coef": self.kl_coef, "skipped_steps": self.skipped_steps,
                "skipped_in_a_row": self.skipped_in_a_row, "checkpoint_failures": self.checkpoint_failures,
                "data_cursor": dict(self.data_cursor), "quarantined": dict(self.quarantined),
                "mlflow_run_id": self.mlflow_run_id}

    @classmethod
    def from_json(cls, data: dict) -> "LearnerState":
        if data.get("format") != STATE_FORMAT:
            raise ValueError(f"learner state format {data.get('format')!r} is not {STATE_FORMAT}")
        return cls(version=int(data["version"]), groups_consumed=int(data["groups_consumed"]),
                   groups_by_generator=dict(data["groups_by_generator"]),
                   dropped_total=Counter(data["dropped_total"]), unacked=list(data["unacked"]),
                   kl_coef=data["kl_coef"], skipped_steps=int(data.get("skipped_steps", 0)),
                   skipped_in_a_row=int(data.get("skipped_in_a_row", 0)),
                   checkpoint_failures=int(data.get("checkpoint_failures", 0)),
                   data_cursor=dict(data["data_cursor"]),
                   quarantined={str(gen): str(why) for gen, why in data.get("quarantined", {}).items()},
                   mlflow_run_id=str(data.get("mlflow_run_id") or ""))


class AckLedger:
    """When the buffer may forget a trained group: only once a checkpoint covering its step is on disk.

    `state.unacked` lists the receipts taken since the last checkpoint and is saved inside each checkpoint, so a
    learner killed between writing a checkpoint and acknowledging acknowledges those at restart instead of training
    them twice. A background save is acknowledged once it is known to be complete (the next save, or the end). Only
    rank 0 holds a buffer; the other ranks' ledgers hold nothing.
    """

    def __init__(self, buffer, state: LearnerState):
        self.buffer = buffer
        self.state = state
        self.awaiting: list = []  # covered by a background save still being written
        if buffer is not None and state.unacked:
            buffer.on_checkpoint(list(state.unacked))  # covered by the checkpoint we resumed from
        state.unacked = []

    def note_taken(self) -> None:
        """After a step: the groups the buffer handed out are owed an acknowledgement."""
        if self.buffer is not None:
            self.state.unacked.extend(self.buffer.take_receipts())

    def checkpointed(self, background: bool) -> None:
        """A checkpoint holding `state` (with its unacked list) was written, or is being written in the background."""
        if self.buffer is None:
            return
        if self.awaiting:  # the previous background save finished before this one started
            self.buffer.on_checkpoint(self.awaiting)
        covered, self.state.unacked = self.state.unacked, []
        self.awaiting = covered if background else []
        if not background and covered:
            self.buffer.on_checkpoint(covered)

    def all_saved(self) -> None:
        """Every save is complete (the end of the job)."""
        if self.buffer is not None and self.awaiting:
            self.buffer.on_checkpoint(self.awaiting)
            self.awaiting = []
