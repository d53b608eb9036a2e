"""The declared interfaces between a generator and the learner's buffer, whichever backend carries them.

Two sides, one `typing.Protocol` each, implemented by both backends (`buffer/zmq/`, `buffer/redis/`):

- `LearnerBuffer`, what the learner loop calls: start, take groups (validated), give back the admission of a group
  it will not train, announce published weights and the new version, forget what a checkpoint covers, finish the
  job (the "done" handshake of `buffer/done.py`), metrics, close.
- `GeneratorBuffer`, what a generator calls: hello, admit, release, send, eval_done, report, bye. Every call
  returns a typed reply (the dataclasses below), never a dict to be read by key: a field a backend forgot is then a
  TypeError at its source, not a silent `None` in the rollout loop.

`buffer/backends.py` builds the right pair from `buffer.backend`. The exceptions both backends raise live here too,
so callers never import one backend to catch the other's errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from asyncrl.weightsync.announcement import AnnouncementError, WeightsAnnouncement


class LearnerUnavailable(RuntimeError):
    """The learner (or, with Redis, the server holding its state) did not answer in time: not started yet, crashed,
    or unreachable. The message names the endpoint."""


class GeneratorRefused(RuntimeError):
    """The learner refused this generator (for example, it was started with a different recipe). `learner_config`:
    the learner's shared sections when the refusal is a config mismatch, so the generator can name the keys."""

    def __init__(self, message: str, learner_config=None):
        super().__init__(message)
        self.learner_config = learner_config if isinstance(learner_config, dict) else None  # as the learner sent it


@dataclass
class Rejections:
    """Groups this generator sent earlier that the learner found invalid when it took them, since its last reply."""

    count: int
    last_error: str


@dataclass
class Status:
    """What every reply carries: the newest weights' announcement, whether the job is over, and groups found
    invalid. The learner's published version is `weights.version`: a generator follows the weights it can load, so
    the typed reply carries no second, bare version that could disagree with them."""

    weights: WeightsAnnouncement | None = None
    """The announcement of the newest published weights (weightsync/announcement.py); None before the first
    publish. Each backend's client decodes it from the wire once per new announcement, and a malformed one is an
    AnnouncementError naming the field."""
    done: bool = False
    """The job is over: the generator stops (buffer/done.py)."""
    rejected: Rejections | None = None
    """Groups found invalid since the last reply: the learner validates a group when it takes it (zmq) or reads
    it (Redis: the news waits in Redis for the generator's next control request, buffer/redis/rejection_news.py)."""


@dataclass(frozen=True)
class RunInfo:
    """What the learner tells every generator that joins: where the model, the data and the run's record are, and
    which of the learner's features the generator must follow. Built by the learner alone (learner/host.py) and
    carried in the hello reply, as a plain dict (`to_wire`) in msgpack (zmq) or JSON (Redis)."""

    model_path: str
    """The learner's model directory (absolute): a generator on its host loads it from there."""
    train_files: tuple[str, ...]
    """The training data (absolute paths): a generator that is dealt no prompts walks its own copy."""
    mlflow_run_id: str
    tracking_uri: str
    host: str
    """The learner's host name (a local MLflow store is only reachable from it)."""
    job_dir: str
    job: str
    model_files: str = ""
    """Digest of the model's non-weight files the catch-up server serves ("": none; a generator needs the model on
    its own host)."""
    lora_rank: int = 0
    """learner.lora.rank when the learner trains a LoRA adapter (the engines size their adapter slots from it)."""
    deals: bool = False
    """The learner deals the prompts (buffer/dealing.py)."""
    data_sources: tuple[str, ...] = ()
    """The dealt data's sources, for the generator's reward check (with `deals`)."""
    deal_timeout_s: float = 1800.0
    """data.deal_timeout_s: a dealt prompt not answered within it is dealt again (with `deals`)."""
    evals: bool = False
    """The learner runs evaluation rounds (a Redis generator asks for their prompts only then)."""
    routing_replay: bool = False
    """learner.moe_routing_replay: the learner replays MoE routes, so the generators' engines record them and every
    sample carries its own (moe/routing.py); the learner's setting, whatever the generator's recipe says."""

    def to_wire(self) -> dict:
        return {"model_path": self.model_path, "train_files": list(self.train_files),
                "mlflow_run_id": self.mlflow_run_id, "tracking_uri": self.tracking_uri, "host": self.host,
                "job_dir": self.job_dir, "job": self.job, "model_files": self.model_files, "lora_rank": self.lora_rank,
                "deals": self.deals, "data_sources": list(self.data_sources), "deal_timeout_s": self.deal_timeout_s,
                "evals": self.evals, "routing_replay": self.routing_replay}

    @classmethod
    def from_wire(cls, wire, endpoint: str) -> RunInfo:
        """The run info a hello reply carries, or RunInfoError naming the learner (`endpoint`) and the field."""
        if not isinstance(wire, dict):
            raise RunInfoError(f"the learner at {endpoint} sent run info that is not a mapping")
        fields = {}
        for name, (kinds, wanted) in _RUN_INFO_TYPES.items():
            if name not in wire:
                if name in _RUN_INFO_REQUIRED:
                    raise RunInfoError(f"the learner at {endpoint} sent run info without {name!r}")
                continue
            value = wire[name]
            ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
            if ok and kinds == (list, tuple):
                ok = all(isinstance(item, str) for item in value)
                value = tuple(value)
            if not ok:
                raise RunInfoError(f"the learner at {endpoint} sent run info whose {name!r} is "
                                   f"{type(value).__name__}, expected {wanted}")
            fields[name] = float(value) if name == "deal_timeout_s" else value
        return cls(**fields)


class RunInfoError(ValueError):
    """Run info that is not well formed (the message names the learner and the field)."""


_RUN_INFO_REQUIRED = ("model_path", "train_files", "mlflow_run_id", "tracking_uri", "host", "job_dir", "job")
_STRINGS = ((list, tuple), "a list of strings")
_RUN_INFO_TYPES = {"model_path": ((str,), "a string"), "train_files": _STRINGS, "mlflow_run_id": ((str,), "a string"),
                   "tracking_uri": ((str,), "a string"), "host": ((str,), "a string"), "job_dir": ((str,), "a string"),
                   "job": ((str,), "a string"), "model_files": ((str,), "a string"), "lora_rank": ((int,), "an integer"),
                   "deals": ((bool,), "a boolean"), "data_sources": _STRINGS,
                   "deal_timeout_s": ((int, float), "a number"), "evals": ((bool,), "a boolean"),
                   "routing_replay": ((bool,), "a boolean")}


@dataclass
class HelloReply(Status):
    run_info: RunInfo | None = None
    """What the learner tells every generator (always set in a hello reply; the default only follows `Status`'s)."""


@dataclass
class AdmitReply(Status):
    granted: int = 0
    """Groups this generator may start now (0: the staleness budget is used up; ask again later)."""
    deals: list = field(default_factory=list)
    """When the learner deals the prompts (buffer/dealing.py): one (deal id, row bytes) per grant, the prompt to
    sample, which the generator decodes (data/prompts.py::decode_prompt); [] when the generator walks its own copy
    of the dataset (a learner without data)."""
    evals: list = field(default_factory=list)
    """Held-out prompts to evaluate at a pinned weight version (`EvalTask`s, buffer/eval_rounds.py), beside the
    grants: they take no admission."""


@dataclass
class EvalTask:
    """One held-out prompt of an evaluation round: sample it `n` times at `temperature` with the weights of exactly
    `version`, score it, and send the rewards and lengths back (`GeneratorBuffer.eval_done`)."""

    deal_id: str
    version: int
    row: bytes
    """The prompt, encoded as a deal carries it: the generator decodes it (data/prompts.py::decode_prompt)."""
    n: int
    temperature: float
    max_tokens: int


@dataclass
class SendReply(Status):
    accepted: bool = False
    """The group is queued (zmq) or in the stream (Redis). Validation may still reject it later (see `rejected`)."""
    retry: bool = False
    """Not accepted because the learner's queue is full: keep the group and send it again."""
    reason: str = ""
    """Why it was refused (e.g. too_large), when not accepted and not retried."""
    error: str = ""


def too_large_reply(size: int, limit: int, weights: WeightsAnnouncement | None) -> SendReply:
    """A group over the job's limit (buffer.max_message_bytes) is refused by the client itself, with the reply the
    learner would give, at any size: a much larger message would only be dropped by the transport, unanswered."""
    return SendReply(weights=weights, accepted=False, reason="too_large",
                     error=f"message: {size} bytes exceeds max_message_bytes={limit} [too_large]")


def decode_weights(wire, endpoint: str) -> WeightsAnnouncement | None:
    """The announcement a reply's `weights` carries (None before the first publish); a malformed one is an
    AnnouncementError naming the learner and the field, never a KeyError in the generator's rollout loop."""
    if not wire:
        return None
    try:
        return WeightsAnnouncement.from_wire(wire)
    except AnnouncementError as err:
        raise AnnouncementError(f"the learner at {endpoint} sent a malformed weights announcement: {err}") from None


class GeneratorBuffer(Protocol):
    """A generator's connection to the learner's buffer. Coroutines run on the generator's event loop; each waits
    at most the backend's request timeout (buffer.request_timeout_s, or `timeout_s` where given) and raises
    LearnerUnavailable naming the endpoint when nobody answers."""

    endpoint: str
    generator_id: str

    async def hello(self, config_hash: str, timeout_s: float | None = None) -> HelloReply:
        """Join the job; raises GeneratorRefused when the learner's shared-config hash differs."""

    async def admit(self, want: int = 1, version: int | None = None) -> AdmitReply:
        """Ask to start up to `want` groups (the staleness budget, buffer/staleness.py). `version`: the weight
        version the generator's engine holds, so that evaluation rounds of that version or later can be dealt."""

    async def send(self, group_id: str, payload: bytes, deal: str = "") -> SendReply:
        """Deliver one encoded group (buffer/codec.py); idempotent on group_id. `deal`: the id of the dealt prompt
        it answers (buffer/dealing.py), "" when none was dealt."""

    async def release(self, count: int = 1, deals: list | None = None, outcome: str = "unused",
                      rewards: list | None = None) -> Status:
        """Give back `count` admissions this generator holds and will not deliver (groups its own filter dropped,
        algo.dynamic_sampling), so their capacity returns now; never more than it holds. `deals`: the dealt
        prompts' ids, and what became of them (`outcome`): `unused` grants go back to the epoch, `zero_variance`
        and `skipped` prompts are consumed (buffer/dealing.py). `rewards`: the rewards of the one group the
        generator sampled and dropped (`count` 1), so the learner's reward of what the policy sampled counts it
        (buffer/sampled.py); None when no group was sampled."""

    async def eval_done(self, deal_id: str, rewards: list | None, lengths: list | None,
                        texts: list | None = None) -> Status:
        """The result of an `EvalTask`: its n rewards and completion lengths, and the completions as text (the
        learner's table of the round's samples); None, None gives it back (the generator could not sample it at
        its version)."""

    async def report(self, metrics: dict, timeout_s: float | None = None) -> Status:
        """This generator's statistics, for the learner's metrics."""

    async def bye(self, timeout_s: float | None = None) -> None:
        """Leaving before the job is done: admissions held and not delivered are given back at once."""

    def close(self) -> None:
        """Release sockets and connections (no request is sent)."""


class PromptDealing(Protocol):
    """What the learner asks the prompt dealer that serves a buffer's admissions (buffer/dealing.py in the zmq
    learner's memory; buffer/redis/dealing.py with the cursor in Redis)."""

    def exhausted(self) -> bool:
        """Every prompt of the last epoch (data.epochs) was taken: the job ends with the batch in hand."""

    def snapshot(self) -> dict:
        """The cursor, for the learner's checkpoint (dealer.PromptDealer's format)."""

    def metrics(self) -> dict:
        """data/* metrics: epoch, dealt, consumed, out, returned and filtered by reason."""


class LearnerBuffer(Protocol):
    """The learner's side of the buffer. Called from the learner's thread only; a backend that serves generators
    from a thread of its own (zmq) keeps that thread's state behind these calls."""

    endpoint: str
    dealer: PromptDealing | None
    """The prompt dealer serving the admissions; None when the generators walk their own copy of the data."""

    def start(self) -> None:
        """Begin serving generators."""

    def take(self, timeout_s: float):
        """The next valid `Group`, or None after `timeout_s`. Invalid groups met on the way are rejected, counted
        under buffer/rejected/<reason> and logged; they never reach the caller."""

    def take_sampled(self) -> dict:
        """The reward of every group the policy sampled that this buffer heard of since the last call (taken, or
        dropped by its generator with its rewards in the release), as a step's `reward/sampled_*` metrics
        (buffer/sampled.py); {} when there was none."""

    def sampled_so_far(self):
        """buffer/sampled.py SampledSoFar: every group heard of since the learner started (for learner/learnable.py)."""

    def give_back(self, group, reason: str = "stale") -> None:
        """A taken group that will never be trained (`reason`: stale, zero_variance, ...): its admission frees
        capacity, if it held one, and its dealt prompt goes back to the epoch (or, filtered, stays consumed)."""

    def quarantine(self, groups: list, reason: str, detail: str = "poisoned a step") -> None:
        """Taken groups that will never be trained or replayed: their step failed (a NaN, a batch that could not be
        built), or their generator is quarantined (learner/trust.py). Each is counted under
        buffer/rejected/<reason>, gives back its admission if it held one, (zmq) is told to its generator in its
        next reply with `detail`, and (Redis) moves to the dead-letter stream, `detail` in its reason."""

    def announce_weights(self, message: WeightsAnnouncement) -> None:
        """Tell generators about newly published weights (their announcement)."""

    def set_version(self, version: int) -> None:
        """The learner's version, once the weights of `version` are published (never before: buffer/staleness.py)."""

    def take_receipts(self) -> list[str]:
        """Receipts of the groups `take` returned since the last call, to keep in the learner state until a
        checkpoint covers them ([] for a backend with nothing to acknowledge)."""

    def on_checkpoint(self, receipts: list[str]) -> None:
        """A checkpoint covering these groups is on disk: the buffer may forget them (Redis acks them)."""

    def finish(self, grace_s: float) -> list[str]:
        """The job is over: tell every generator (buffer/done.py); returns those not told within `grace_s`."""

    def serve_evals(self) -> None:
        """Move evaluation results in and prompts out now (at the end of the job nobody calls `take`, which does
        it with Redis); a no-op where a server thread does it (zmq)."""

    def live_generators(self) -> list[str]:
        """Generators heard from recently (for error messages, and whether an evaluation round can still be
        answered at the end of the job)."""

    def generators(self) -> dict:
        """generator id -> its join record (version at hello, oldest token version of its first group)."""

    def metrics(self) -> dict:
        """buffer/* metrics (buffer/size, buffer/received, buffer/rejected/<reason>, backend-specific ones) and
        perf/generator/tokens_per_s summed over the generators' reports, timing/generator/idle_frac averaged over
        them (buffer/fleet_stats.py)."""

    def close(self) -> None:
        """Stop serving and release everything."""
