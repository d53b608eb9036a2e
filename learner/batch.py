"""Turning groups into padded tensors and splitting them into mini-batches and token-budget micro-batches.

Every tensor that describes completion tokens is aligned with the learner's logprobs: position t of a [B, L-1]
tensor is the token at input position t+1. Prompt positions and padding have loss_mask 0. Rows are in group
order (row = group * n + sample), which the group-baseline advantage estimators rely on.

The per-step passes (reference logprobs, proximal logprobs, batch-global correction weights, advantages) fill the
optional [B, L-1] fields of the whole batch once; `select` slices every field, so each micro-batch carries its
rows' share of them and `rows` says where they came from.
"""
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L-1] float32
    logprobs_behav: torch.Tensor  # [B, L-1] float32 (generator logprobs, 0 where masked)
    versions: torch.Tensor  # [B, L-1] int64 (-1 where masked)
    token_rewards: torch.Tensor  # [B, L-1] float32: the sample's reward on its last completion token
    temperatures: torch.Tensor  # [B] float32
    rows: torch.Tensor  # [B] int64: row index in the step's full batch
    advantages: Optional[torch.Tensor] = None  # [B, L-1], filled by compute_advantages
    logprobs_prox: Optional[torch.Tensor] = None  # [B, L-1], filled by the proximal pass when one runs
    logprobs_ref: Optional[torch.Tensor] = None  # [B, L-1], filled when a reference model is loaded
    is_weight: Optional[torch.Tensor] = None  # [B, L-1], filled by batch-global corrections (m2po)
    values: Optional[torch.Tensor] = None  # [B, L-1], the critic's values at the step's start (learner/critic.py)
    returns: Optional[torch.Tensor] = None  # [B, L-1], the critic's regression targets (GAE's Â + V, V-trace's v_s)
    process_rewards: Optional[torch.Tensor] = None  # [B, L-1], PRIME's token rewards from its PRM (learner/prm.py)
    top_ks: Optional[torch.Tensor] = None  # [B] int64: the row's sampling top-k (-1 off); None: no row uses one
    top_ps: Optional[torch.Tensor] = None  # [B] float32: the row's sampling top-p (1 off); None: no row uses one
    routed_experts: Optional[torch.Tensor] = None  # [B, L, layers, top_k] int16: the sampler's MoE routes, -1 where
    # a position has none (padding, each row's last token); None: the job does not replay routes (moe/routing.py)
    images: Optional[list] = None  # [B] of data/vision.py's VisionInputs (None for a row without images): a
    # vision-language model's pixels and grids per row, the rows of one group sharing its; None: no row has images

    def vision_inputs(self):
        """The rows' images as the forward takes them (VisionInputs: pixels and grids concatenated in row order),
        None when no row has any."""
        if self.images is None or all(inputs is None for inputs in self.images):
            return None
        from asyncrl.data.vision import VisionInputs

        rows = [inputs for inputs in self.images if inputs is not None]
        return VisionInputs(torch.cat([inputs.pixel_values for inputs in rows]),
                            torch.cat([inputs.image_grid_thw for inputs in rows]))

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "Batch":
        """The given rows, trimmed to their longest sequence (micro-batches carry no extra padding)."""
        length = int(self.attention_mask[rows].sum(-1).max())
        sliced = {}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, list):
                sliced[spec.name] = [value[row] for row in rows.tolist()]
            elif value is None or value.dim() == 1:
                sliced[spec.name] = value if value is None else value[rows]
            else:  # [B, L] inputs keep `length` columns, [B, L-1] token tensors keep `length - 1`
                width = length if value.shape[1] == self.input_ids.shape[1] else length - 1
                sliced[spec.name] = value[rows, :width]
        return Batch(**sliced)

    def to(self, device) -> "Batch":
        """Every tensor on `device` (the same object when it is already there: the CPU learner copies nothing)."""
        if str(device) == "cpu":
            return self
        return Batch(**{spec.name: moved(getattr(self, spec.name), device) for spec in fields(self)})


def moved(value, device):
    """A Batch field on `device`: a tensor, or each row's VisionInputs (None stays None)."""
    if value is None:
        return None
    if isinstance(value, list):
        from asyncrl.data.vision import VisionInputs

        return [None if inputs is None else VisionInputs(inputs.pixel_values.to(device),
                                                         inputs.image_grid_thw.to(device)) for inputs in value]
    return value.to(device)


def build_batch(groups: list, vision=None) -> Batch:
    """One row per sample, in group order. Every group must hold the same number of samples. `vision`: a
    vision-language policy's VisionProcessor (data/vision.py): a group with images (`Group.images`, attached by
    rank 0 from its own copy of the dealt row) has them processed once, its prompt's image pads widened to their
    patches, and every sample row of it shares the pixels."""
    prompts, inputs = widened_prompts(groups, vision)
    rows = [(group, sample) for group in groups for sample in group.samples]
    row_prompts = [prompt for prompt, group in zip(prompts, groups) for _ in group.samples]
    row_images = [images for images, group in zip(inputs, groups) for _ in group.samples]
    length = max(len(prompt) + len(sample.completion_ids) for prompt, (_, sample) in zip(row_prompts, rows))
    batch = len(rows)
    input_ids = np.zeros((batch, length), dtype=np.int64)
    attention_mask = np.zeros((batch, length), dtype=np.int64)
    loss_mask = np.zeros((batch, length - 1), dtype=np.float32)
    behav = np.zeros((batch, length - 1), dtype=np.float32)
    versions = np.full((batch, length - 1), -1, dtype=np.int64)
    rewards = np.zeros((batch, length - 1), dtype=np.float32)
    temps = np.zeros(batch, dtype=np.float32)
    top_ks = np.full(batch, -1, dtype=np.int64)
    top_ps = np.ones(batch, dtype=np.float32)
    for row, (group, sample) in enumerate(rows):
        prompt_len, comp_len = len(row_prompts[row]), len(sample.completion_ids)
        input_ids[row, :prompt_len] = row_prompts[row]
        input_ids[row, prompt_len : prompt_len + comp_len] = sample.completion_ids
        attention_mask[row, : prompt_len + comp_len] = 1
        span = slice(prompt_len - 1, prompt_len - 1 + comp_len)
        loss_mask[row, span] = 1.0 if sample.loss_mask is None else sample.loss_mask
        behav[row, span] = sample.logprobs
        versions[row, span] = sample.versions
        trained = np.flatnonzero(loss_mask[row])
        if trained.size:  # outcome reward on the last token that trains (tool output may end a sample)
            rewards[row, trained[-1]] = sample.reward
        temps[row] = group.sampling.temperature
        top_ks[row], top_ps[row] = group.sampling.top_k, group.sampling.top_p
    nucleus = bool((top_ks > 0).any() or (top_ps < 1).any())
    routes = batch_routes(rows, length)
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        loss_mask=torch.from_numpy(loss_mask),
        logprobs_behav=torch.from_numpy(behav),
        versions=torch.from_numpy(versions),
        token_rewards=torch.from_numpy(rewards),
        temperatures=torch.from_numpy(temps),
        rows=torch.arange(batch),
        top_ks=torch.from_numpy(top_ks) if nucleus else None,
        top_ps=torch.from_numpy(top_ps) if nucleus else None,
        routed_experts=routes,
        images=row_images if any(images is not None for images in row_images) else None,
    )


def widened_prompts(groups: list, vision) -> tuple[list, list]:
    """Each group's prompt as the forward takes it, and its VisionInputs (None without images)."""
    prompts, inputs = [], []
    for group in groups:
        images = group.images
        if not images:
            prompts.append(group.prompt_ids)
            inputs.append(None)
            continue
        if vision is None:
            raise ValueError(f"group {group.group_id} has images and the policy is not a vision-language model")
        processed = vision.process(images)
        prompts.append(np.asarray(vision.widen(list(group.prompt_ids), processed), dtype=np.int64))
        inputs.append(processed)
    return prompts, inputs


def batch_routes(rows: list, length: int) -> Optional[torch.Tensor]:
    """[B, length, layers, top_k] int16 of the samples' routes (`Sample.routed_experts`, positions 0 .. P + T - 2 of
    each row), -1 elsewhere; None when no sample carries any (the codec lets a job's groups carry them all or
    none). int16 keeps a long batch small (8x less than int64); expert indices fit (route_dtype: at most uint16,
    and the models replayed have far fewer than 32768 experts)."""
    carried = [sample.routed_experts for _, sample in rows]
    if all(routes is None for routes in carried):
        return None
    first = next(routes for routes in carried if routes is not None)
    out = np.full((len(rows), length, *first.shape[1:]), -1, dtype=np.int16)
    for row, routes in enumerate(carried):
        if routes is None:
            raise ValueError(f"row {row} carries no routed experts while others do")
        out[row, :len(routes)] = routes
    return torch.from_numpy(out)


def split_minibatches(batch: Batch, num_minibatches: int) -> list[Batch]:
    """Contiguous row ranges, one per optimizer step. Contiguous ranges keep groups together when the number of
    rows divides evenly, so group-level statistics of a mini-batch stay meaningful."""
    if num_minibatches <= 1:
        return [batch]
    if num_minibatches > batch.num_rows:
        raise ValueError(f"algo.ppo_minibatches={num_minibatches} exceeds the batch's {batch.num_rows} rows")
    return [batch.select(chunk) for chunk in torch.arange(batch.num_rows).chunk(num_minibatches)]


def split_microbatches(batch: Batch, max_tokens: int) -> list[Batch]:
    """Rows sorted by length, packed greedily so rows x longest row stays within `max_tokens` per micro-batch."""
    lengths = batch.attention_mask.sum(-1)
    order = torch.argsort(lengths, descending=True)
    micro, current = [], []
    for row in order.tolist():
        longest = int(lengths[current[0]]) if current else int(lengths[row])
        if current and (len(current) + 1) * longest > max_tokens:
            micro.append(batch.select(torch.tensor(current)))
            current = []
        current.append(row)
    if current:
        micro.append(batch.select(torch.tensor(current)))
    return micro


def scatter_rows(full_shape: tuple, parts: list[tuple[torch.Tensor, torch.Tensor]], fill: float = 0.0) -> torch.Tensor:
    """Put per-micro-batch [b, l] tensors back at their rows of a [B, L] tensor (columns beyond l stay `fill`)."""
    dtype = parts[0][1].dtype if parts else torch.float32
    out = torch.full(full_shape, fill, dtype=dtype)
    for rows, values in parts:
        out[rows, : values.shape[1]] = values
    return out


def assign_rows(lengths: list, num_ranks: int) -> list[list[int]]:
    """Rows per data-parallel rank, balanced by tokens: longest first, each onto the least-loaded rank (ties to the
    lowest rank). Deterministic, so every rank computes every rank's share without talking."""
    loads, shares = [0] * num_ranks, [[] for _ in range(num_ranks)]
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        target = min(range(num_ranks), key=lambda rank: (loads[rank], rank))
        shares[target].append(row)
        loads[target] += lengths[row]
    return [sorted(share) for share in shares]


def plan_microbatches(batch: Batch, max_tokens: int, dp_rank: int = 0, dp_size: int = 1) -> list[Optional[Batch]]:
    """This rank's micro-batches of `batch`. With dp_size > 1 the rows are first balanced across ranks by tokens,
    and the list is padded with None so every rank runs the same number of forward/backward passes (FSDP's
    collectives need them in lockstep); a None is a pass that contributes nothing."""
    if dp_size == 1:
        return split_microbatches(batch, max_tokens)
    shares = assign_rows(batch.attention_mask.sum(-1).tolist(), dp_size)
    counts = [len(split_microbatches(batch.select(torch.tensor(share)), max_tokens)) if share else 0
              for share in shares]
    mine = shares[dp_rank]
    micro = split_microbatches(batch.select(torch.tensor(mine)), max_tokens) if mine else []
    return micro + [None] * (max(counts) - len(micro))


def placeholder_microbatch(batch: Batch) -> Batch:
    """A one-row micro-batch for a rank with no rows left: it runs the model (so collectives line up) and is
    multiplied by zero."""
    return batch.select(torch.tensor([0]))
