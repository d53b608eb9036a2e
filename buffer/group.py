"""The `Group`: the n samples one prompt produced, the unit that is transported and admitted.

GRPO-style advantages need every sample of a prompt at once, so the buffer never splits a group. These are
plain data holders (no torch, so generators and the buffer stay light); the wire format and all validation
live in `asyncrl.buffer.codec` (docs/architecture.md §3).

Arrays are numpy with fixed dtypes: token ids and versions are int32, logprobs float32, loss_mask uint8.
The dataclasses use identity equality (`eq=False`) because field-wise `==` on numpy arrays is ambiguous.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

SCHEMA_VERSION = 1
"""Wire schema version written by `encode_group`; a decoder rejects versions it does not know."""

FINISH_REASONS = ("stop", "length", "abort", "max_turns", "max_episode_tokens", "env_error")
"""Why a completion ended: a stop token/string (or, in an episode, the answer), `max_tokens` (in an episode: of a
turn), the engine aborted it (e.g. weight swap); and for multi-turn episodes the budget that ended it
(rollout.max_turns, rollout.max_episode_tokens or the model's positions) or an environment that failed."""


@dataclass
class Sampling:
    """Sampling parameters the generator used, carried so the learner can tell how a group was produced."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k (vLLM convention)."""
    max_tokens: int = 16
    """Completion length cap, in tokens."""


@dataclass(eq=False)
class Sample:
    """One completion of the prompt, with per-token behaviour logprobs and policy versions."""

    completion_ids: np.ndarray
    """int32 [T] generated token ids."""
    logprobs: np.ndarray
    """float32 [T] behaviour-policy logprob of each generated token (<= 0)."""
    versions: np.ndarray
    """int32 [T] learner version of the weights that produced each token; a weight swap mid-completion
    makes these differ within one sample, which is why they are per token."""
    reward: float
    finish_reason: str
    """One of FINISH_REASONS."""
    loss_mask: np.ndarray | None = None
    """uint8 [T], 1 = train on this token; None means every completion token counts."""
    reward_info: dict[str, float] = field(default_factory=dict)
    """Named reward components (e.g. format, correctness) for logging only."""
    episode: int | None = None
    """rollout.turn_samples=per_turn: the index (0 .. n-1) of the episode this sample is one model turn of; its
    turns share its reward and its advantage (docs/agents.md, "Reasoning templates"). None: the sample is a whole
    completion or episode, its own."""
    routed_experts: np.ndarray | None = None
    """learner.moe_routing_replay: the experts the sampler routed each position to, [P + T - 1, num_layers, top_k]
    (prompt and completion tokens alike, all but the last token, which was never run through the model; dense
    layers 0), dtype `route_dtype(num_experts)`; vLLM's `CompletionOutput.routed_experts` layout. None: not
    recorded (the job does not replay routes)."""


@dataclass(eq=False)
class Group:
    """All samples of one prompt, as admitted to the buffer."""

    group_id: str
    """Unique id (uuid4 hex); buffers are idempotent on it, so a resend is harmless."""
    prompt_id: str
    """Stable id of the prompt in its dataset."""
    generator_id: str
    prompt_ids: np.ndarray
    """int32 [P] prompt token ids."""
    samples: list[Sample]
    sampling: Sampling
    created_at: float
    """Unix seconds at admission."""
    meta: dict[str, str | int | float] = field(default_factory=dict)
    """Free-form scalars: data_source, ground truth id, ..."""
    schema: int = SCHEMA_VERSION
    images: list | None = None
    """The learner's own: a multimodal prompt's encoded images, attached on rank 0 from the row it dealt under
    `prompt_id` (learner/loop.py). Never on the wire (the codec writes its keys by name): a generator cannot pair a
    prompt with images of its choosing."""

    def min_version(self) -> int:
        """Oldest learner version behind any model token (loss_mask 1; every completion token without a mask);
        staleness is measured from this. Environment tokens of an episode were sampled by no policy.

        A sample with no model tokens contributes nothing. Returns -1 when the group has none at all (nothing in
        it can be stale, and -1 is never a real version).
        """
        versions = []
        for sample in self.samples:
            model = sample.versions if sample.loss_mask is None else sample.versions[sample.loss_mask.astype(bool)]
            if len(model):
                versions.append(int(model.min()))
        return min(versions) if versions else -1

    def num_completion_tokens(self) -> int:
        """Total generated tokens across all samples."""
        return sum(len(s.completion_ids) for s in self.samples)

    def rewards(self) -> list[float]:
        """The scalar reward of each sample, in sample order."""
        return [s.reward for s in self.samples]

    def episode_rewards(self) -> list[float]:
        """One reward per episode (per sample when the samples are whole episodes): what rollout.n counts."""
        if all(s.episode is None for s in self.samples):
            return self.rewards()
        first: dict[int, float] = {}
        for s in self.samples:
            first.setdefault(s.episode, s.reward)
        return [first[index] for index in sorted(first)]

    def zero_variance(self) -> bool:
        """Every sample's reward is the same: a group baseline makes every advantage 0, so the group teaches
        nothing (DAPO's dynamic sampling drops it: the generator that sampled it, and the learner again)."""
        rewards = self.rewards()
        return not rewards or max(rewards) == min(rewards)


def route_dtype(num_experts: int) -> np.dtype:
    """The dtype routes travel in: one byte an expert index up to 256 experts (as vLLM returns them), else two."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def new_group_id() -> str:
    """A fresh group id (uuid4 hex): random, so generators need no coordination to stay unique."""
    return uuid.uuid4().hex
