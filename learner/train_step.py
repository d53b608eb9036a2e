"""One learner step on one batch of groups, written as the algorithm reads (docs/architecture.md §5).

build_batch -> compute_reference_logprobs (only with a KL term) -> penalise_rewards (KL in the reward) ->
recompute_prox_logprobs (only when π_prox is needed before the first update) -> compute_advantages ->
compute_batch_weight (only for a batch-global correction) -> for each of algo.ppo_minibatches mini-batches:
forward_backward every micro-batch, optimizer_step. With PPO's critic (learner/critic.py) its no-grad values come
before the advantages (GAE, or V-trace's baseline) and its own update after the policy's; with PRIME's implicit PRM
(learner/prm.py) its token rewards come before the advantages, and its own update before them or after the policy's.

Which of those optional phases run is the run's `OffPolicyPlan` (built once per step from `algo`): with one
optimizer step per batch and no batch-global correction, π_prox (the policy at the start of the step) is exactly
the current pass before any update, so its logprobs are the detached current ones and the separate no-grad pass
is skipped (`plan.prox_source`). All the math comes from `asyncrl.algos`.

Two guards keep one bad batch from poisoning the model (the learner loop decides what follows, learner/loop.py):
- building the batch and its advantages is data-dependent and the same on every rank; a failure there raises
  `PoisonedBatch` before any collective, so every rank skips the step together;
- an optimizer step whose global gradient norm is not finite is not taken: the gradients are dropped, the weights
  and the optimizer state stay as they were (`optimizer_step`). A step none of whose mini-batches stepped comes
  back with `StepResult.stepped` False (and `learner/skipped` in its metrics), and the loop neither moves the
  version nor publishes.
"""
import time
from dataclasses import dataclass, field

import torch

from asyncrl.algos.advantages import AdvantageInputs, compute_gae_advantages, compute_token_advantages
from asyncrl.algos.turn_advantages import compute_turn_advantages
from asyncrl.algos.corrections import compute_correction, compute_vtrace_advantages, normalize_batch_weight
from asyncrl.algos.vtrace import compute_vtrace_advantages_and_targets
from asyncrl.algos.kl import apply_kl_penalty
from asyncrl.algos.metrics import combine_token_metrics, compute_group_abs_diff
from asyncrl.algos.offpolicy_plan import (ADVANTAGE_GAE, ADVANTAGE_PRIME, ADVANTAGE_VTRACE, PROX_RECOMPUTE,
                                          WEIGHT_BATCH, OffPolicyPlan)
from asyncrl.algos.prime import compute_prime_advantages
from asyncrl.learner.batch import (Batch, build_batch, placeholder_microbatch, plan_microbatches, scatter_rows,
                                   split_minibatches)
from asyncrl.learner.critic import Critic, compute_batch_values, train_critic, value_metrics
from asyncrl.learner.logprobs import compute_logprobs
from asyncrl.learner.objective import StepCounts, compute_micro_loss, resolve_prox
from asyncrl.learner.optimizer_step import losses_finite, optimizer_step
from asyncrl.learner.parallel import ParallelState, all_gather_objects, all_reduce_sum
from asyncrl.learner.precision import autocast_context
from asyncrl.learner.prm import ImplicitPRM, process_metrics, process_rewards, train_prm
from asyncrl.learner.step_metrics import collect_step_metrics


class PoisonedBatch(ValueError):
    """The batch could not be built or scored (its groups are at fault, not the model); no rank has trained on it."""


@dataclass
class StepResult:
    """What one train_step did: its metrics, and the two facts the loop decides on (never read from the metrics)."""

    metrics: dict
    """The step's metrics (docs/architecture.md §10 names)."""
    stepped: bool
    """The step counts as trained and the version moves on: some mini-batch took its optimizer step, or the
    critic's warmup held the policy still on purpose. False: every step was refused (a non-finite loss or
    gradient), nothing moved, and the batch poisoned the step."""
    moved: bool
    """The policy's weights changed: an optimizer step was taken on a non-zero gradient. A batch whose
    advantages are all 0, or a critic warmup step, may rightly publish the previous version's bytes again."""
    group_abs_diff: list = field(default_factory=list)
    """Per group, in the batch's order: (Σ |ℓlearner - ℓμ| over its trained tokens, their count), ℓlearner from
    the pass that trained the token; what learner/trust.py judges each generator by."""


@dataclass
class StepSettings:
    """The learner-side numbers one step needs (explicit, so train_step never reads the whole config)."""

    version: int
    """Learner version before this step (= optimizer steps done); tokens carry versions <= it."""
    max_staleness: int
    max_tokens_per_microbatch: int
    chunk_tokens: int
    grad_clip: float
    seed: int = 0
    packing: bool = False
    """Pack each micro-batch's rows into one (learner.packing)."""
    fp32_head: bool = False
    """The LM head's matmul in fp32 (model.lm_head_fp32)."""
    autocast: str = ""
    """learner.autocast: the dtype the model's passes autocast to ("" off; learner/precision.py)."""
    liger: bool = False
    """The LM head's logprobs through liger-kernel's fused linear + cross-entropy (learner.liger; CUDA)."""
    parallel: ParallelState = None
    """This rank's place in the learner's mesh; None is one process."""
    routing: object = None
    """The policy's RoutingReplay (moe/routing.py) when learner.moe_routing_replay: each forward replays its
    micro-batch's routes."""
    vision: object = None
    """A vision-language policy's VisionProcessor (data/vision.py): the batch's images become pixels and widened
    prompts with it."""

    def __post_init__(self):
        if self.parallel is None:
            self.parallel = ParallelState()

    def microbatches(self, batch: Batch) -> list:
        """This rank's micro-batches (None = a placeholder pass); the token budget is per rank, so an SP group's
        micro-batch holds sp_size times as many tokens."""
        parallel = self.parallel
        return plan_microbatches(batch, self.max_tokens_per_microbatch * parallel.sp_size, parallel.dp_rank,
                                 parallel.dp_size)

    def logprobs(self, model, micro: Batch, with_entropy: bool = False):
        """Logprobs (and entropy) of a micro-batch already on the learner's device. With routing replay the
        micro-batch's routes are set first, and stay set through its backward (a checkpointed layer's recompute
        replays them too)."""
        if self.routing is not None:
            self.routing.set_routes(micro.routed_experts)
        with autocast_context(micro.input_ids.device.type, self.autocast):
            return compute_logprobs(model, micro.input_ids, micro.attention_mask, micro.temperatures,
                                    self.chunk_tokens, with_entropy=with_entropy, packed=self.packing,
                                    sp_group=self.parallel.sp_group,
                                    top_ks=micro.top_ks, top_ps=micro.top_ps, fp32_head=self.fp32_head,
                                    liger=self.liger, vision=micro.vision_inputs())


@torch.no_grad()
def compute_batch_logprobs(model, batch: Batch, settings: StepSettings) -> torch.Tensor:
    """No-grad logprobs [B, L-1] of the whole batch, micro-batch by micro-batch; each DP rank computes its rows and
    a sum over the DP group (rows are disjoint) gives every rank the whole batch."""
    parts, device = [], settings.parallel.device
    for micro in settings.microbatches(batch):
        if micro is None:  # FSDP's all-gathers must run on every rank
            settings.logprobs(model, placeholder_microbatch(batch).to(device))
            continue
        logprobs, _ = settings.logprobs(model, micro.to(device))
        parts.append((micro.rows, logprobs.cpu()))
    full = scatter_rows(tuple(batch.loss_mask.shape), parts)
    if settings.parallel.dp_group is None:
        return full
    return all_reduce_sum(full.to(device), settings.parallel.dp_group).cpu()  # NCCL reduces device tensors


def penalise_rewards(batch: Batch, algo, kl_controller) -> tuple[torch.Tensor, dict]:
    """Token rewards minus β·KL(μ‖ref) per token when algo.kl_reward_coef > 0 (β from the controller)."""
    if algo.kl_reward_coef <= 0:
        return batch.token_rewards, {}
    coef = kl_controller.value
    rewards, kl = apply_kl_penalty(batch.token_rewards, batch.logprobs_behav, batch.logprobs_ref, batch.loss_mask,
                                   coef=coef, kind=algo.kl_reward_type)
    # verl's convention: the controller sees the per-token mean KL of each sequence, averaged over sequences
    token_kl = float(((kl * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1).clamp(min=1)).mean())
    kl_controller.update(token_kl, batch.num_rows)
    return rewards, {"kl/reward_coef": coef, "kl/reward_token_kl": token_kl}


def compute_advantages(batch: Batch, groups: list, token_rewards: torch.Tensor, algo,
                       plan: OffPolicyPlan, prm_cfg=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B, L-1] advantages, 0 off-mask; the critic's targets [B, L-1], or None without a critic), on the plan's
    advantage path. GAE and V-trace's critic baseline read the critic's step-start values, `batch.values`; PRIME
    reads its PRM's token rewards, `batch.process_rewards`, weighted as `prm_cfg` (the prm section) says."""
    if plan.advantage_path == ADVANTAGE_VTRACE:
        return vtrace_advantages(batch, len(groups), token_rewards, plan)
    mask = batch.loss_mask
    if plan.advantage_path == ADVANTAGE_PRIME:
        outcome = torch.where(mask.bool(), token_rewards, torch.zeros_like(token_rewards)).sum(-1)
        advantages, _ = compute_prime_advantages(batch.process_rewards.double(), outcome.double(), mask,
                                                 len(groups[0].samples), process_coef=prm_cfg.process_coef,
                                                 outcome_coef=prm_cfg.outcome_coef)
        return advantages.float(), None
    if plan.advantage_path == ADVANTAGE_GAE:
        advantages, returns = compute_gae_advantages(token_rewards.double(), batch.values.double(), mask,
                                                     gamma=algo.gamma, lam=algo.lam)
        return advantages.float(), returns.float()
    row_episodes = episode_rows(groups)
    if row_episodes is not None:  # per-turn samples: each turn gets its episode's advantage
        return compute_turn_advantages(plan.estimator, token_rewards.double(), mask, row_episodes,
                                       len(groups[0].episode_rewards()), norm_by_std=algo.norm_adv_by_std).float(), None
    baseline = None
    if plan.greedy_baseline:
        baseline = torch.tensor([float(group.meta["baseline_reward"]) for group in groups], dtype=torch.float64)
    inputs = AdvantageInputs(token_rewards=token_rewards.double(), loss_mask=mask,
                             group_size=len(groups[0].samples), baseline_rewards=baseline)
    return compute_token_advantages(plan.estimator, inputs, norm_by_std=algo.norm_adv_by_std, gamma=algo.gamma,
                                    eta=algo.sppo_eta if plan.estimator == "sppo" else None,
                                    sppo_target=algo.sppo_target).float(), None


def episode_rows(groups: list) -> torch.Tensor | None:
    """[B] the episode of each row (group index * n + its episode in the group) when any group holds per-turn
    samples (rollout.turn_samples=per_turn), else None. A group of whole episodes counts each sample as one."""
    if all(sample.episode is None for group in groups for sample in group.samples):
        return None
    rows, base = [], 0
    for group in groups:
        rows += [base + (index if sample.episode is None else sample.episode)
                 for index, sample in enumerate(group.samples)]
        base += len(group.episode_rewards())
    return torch.tensor(rows, dtype=torch.long)


def vtrace_advantages(batch: Batch, num_groups: int, token_rewards: torch.Tensor,
                      plan: OffPolicyPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
    """V-trace replaces the estimator (its importance weights live in the advantages); its baseline is the plan's
    `vtrace_baseline`: none, each prompt's mean reward, or the critic (which then also gets V-trace's targets)."""
    mask = batch.loss_mask
    seq_rewards = (token_rewards * mask).sum(-1).double()  # [B]
    prox, behav = batch.logprobs_prox.double(), batch.logprobs_behav.double()
    if plan.vtrace_baseline == "critic":
        advantages, targets = compute_vtrace_advantages_and_targets(prox, behav, mask, seq_rewards,
                                                                    batch.values.double(), **plan.vtrace_kwargs)
        return advantages.float(), targets.float()
    values = None
    if plan.vtrace_baseline == "group_mean":
        per_group = seq_rewards.view(num_groups, -1)  # [G, n]
        group_mean = per_group.mean(-1, keepdim=True).expand_as(per_group).reshape(-1, 1)  # [B, 1]
        values = group_mean * mask.double()  # V(x_t) = the prompt's mean reward, at every t
    advantages = compute_vtrace_advantages(prox, behav, mask, seq_rewards, values, **plan.vtrace_kwargs)
    return advantages.float(), None


def compute_batch_weight(batch: Batch, plan: OffPolicyPlan) -> tuple[torch.Tensor | None, dict | None]:
    """The weight [B, L-1] of a batch-global correction (m2po: its mask depends on every token of the batch) and
    its metrics, computed once from the recomputed π_prox; (None, None) when the plan has none."""
    if plan.weight_source != WEIGHT_BATCH:
        return None, None
    weight, metrics = compute_correction(plan.weight_correction, batch.logprobs_prox, batch.logprobs_behav,
                                         batch.loss_mask, **plan.weight_kwargs)
    if plan.weight_batch_norm is not None:  # algo.is_batch_norm: self-normalised over the whole batch
        weight, norm_metrics = normalize_batch_weight(weight, batch.loss_mask, plan.weight_batch_norm)
        metrics = {**metrics, **norm_metrics}
    return weight, metrics


def forward_backward(model, micro: Batch, plan: OffPolicyPlan, algo, counts: StepCounts, settings: StepSettings,
                     generator: torch.Generator):
    """Current logprobs (with grad) at the sampling temperature, the loss, backward. Returns detached pieces (the
    current logprobs too: before the step's first optimizer update they are the step-start policy's).
    The loss is scaled by the world size because FSDP averages gradients over it (parallel.py)."""
    logprobs, entropy = settings.logprobs(model, micro, with_entropy="grad" if algo.entropy_coef > 0 else True)
    prox = resolve_prox(plan, logprobs, micro, settings.version)
    loss, pg_share, kl_share, entropy_share, metrics = compute_micro_loss(
        plan, algo, logprobs, prox, micro, counts, algo.kl_loss_coef, generator, entropy=entropy)
    (loss * settings.parallel.loss_scale).backward()
    return pg_share, kl_share, entropy_share, metrics, prox.detach(), entropy.detach(), logprobs.detach()


def placeholder_pass(model, batch: Batch, settings: StepSettings) -> None:
    """Forward and backward through every parameter with a zero loss: a rank with fewer micro-batches than its
    peers still joins each of FSDP's all-gathers and reduce-scatters."""
    logprobs, _ = settings.logprobs(model, placeholder_microbatch(batch).to(settings.parallel.device))
    (logprobs.sum() * 0.0).backward()


def gather_over_dp(parallel: ParallelState, losses: tuple, token_metrics, *row_parts):
    """Every DP rank's shares of the step's losses (a tuple of floats, summed), token metrics and per-row parts
    (π_prox, entropy, step-start logprobs), so each rank reports the whole batch. (SP ranks of one group hold the
    same values; gathering over the DP group counts each row once.)"""
    if parallel.dp_group is None:
        return (losses, token_metrics, *row_parts)
    gathered = all_gather_objects((losses, token_metrics, *row_parts), parallel.dp_group)
    return (tuple(sum(g[0][i] for g in gathered) for i in range(len(losses))), [m for g in gathered for m in g[1]],
            *([p for g in gathered for p in g[index]] for index in range(2, 2 + len(row_parts))))


def to_host(losses: tuple, token_metrics: list, *row_parts) -> tuple:
    """The step's loss shares as floats, its token metrics as dicts of floats and its per-row parts on the CPU,
    converted once after the micro-batch loop: float() and .cpu() wait for the device, and doing so inside the
    loop would stall it after every micro-batch (on the CPU this changes nothing)."""
    return (tuple(float(value) for value in losses),
            [{key: float(value) for key, value in metrics.items()} for metrics in token_metrics],
            *([(rows, values.cpu()) for rows, values in parts] for parts in row_parts))


def step_start_logprobs(batch: Batch, plan: OffPolicyPlan, shape: tuple, start_parts: list):
    """The learner's logprobs with the step-start weights and the rows they cover: the recomputed π_prox (every
    row) when the plan made one, else the current pass of the first mini-batch (before any update)."""
    if plan.prox_source == PROX_RECOMPUTE:
        return batch.logprobs_prox, torch.ones(shape[0], dtype=torch.bool)
    rows = torch.zeros(shape[0], dtype=torch.bool)
    for part_rows, _ in start_parts:
        rows[part_rows] = True
    return scatter_rows(shape, start_parts), rows


def data_dependent(what: str, phase, *args):
    """Run a phase whose failure can only come from the groups: a PoisonedBatch, so the step is skipped."""
    try:
        return phase(*args)
    except Exception as err:  # any failure here is the data's (every rank holds the same groups and raises alike)
        raise PoisonedBatch(f"could not {what}: {type(err).__name__}: {err}") from err


def train_step(model, optimizer, scheduler, groups: list, algo, settings: StepSettings, ref_model=None,
               kl_controller=None, critic: Critic | None = None, prm: ImplicitPRM | None = None) -> StepResult:
    """Train on `groups` (one batch); returns its metrics and whether it stepped and moved the weights. With a
    `critic` (PPO's value model, learner/critic.py) its values feed the advantages and it is trained after the
    policy; during critic.warmup_steps the policy's passes run (for the step's metrics) but it takes no step. With a
    `prm` (PRIME's implicit PRM, learner/prm.py) its token rewards feed the advantages, and it trains before it
    scores the batch or after the policy has stepped (prm.update)."""
    started = time.perf_counter()
    plan = OffPolicyPlan.from_algo(algo)
    batch = data_dependent("build the batch", build_batch, groups, settings.vision)
    if ref_model is not None:
        batch.logprobs_ref = compute_batch_logprobs(ref_model, batch, settings)
    token_rewards, kl_metrics = penalise_rewards(batch, algo, kl_controller)
    if plan.prox_source == PROX_RECOMPUTE:
        batch.logprobs_prox = compute_batch_logprobs(model, batch, settings)
    if critic is not None:
        batch.values = compute_batch_values(critic, batch, settings)
    prm_metrics = {}
    if prm is not None:
        if prm.cfg.update == "before":
            prm_metrics = train_prm(prm, batch, len(groups[0].samples), settings)
        batch.process_rewards, log_ratio = process_rewards(compute_batch_logprobs(prm.model, batch, settings), batch,
                                                           prm.cfg)
        prm_metrics.update(process_metrics(batch.process_rewards, log_ratio, batch.loss_mask))
    batch.advantages, batch.returns = data_dependent("compute the advantages", compute_advantages, batch, groups,
                                                     token_rewards, algo, plan, prm.cfg if prm is not None else None)
    warmup = critic is not None and critic.in_warmup(settings.version)
    batch.is_weight, correction_metrics = compute_batch_weight(batch, plan)
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + settings.version)
    pg_loss, kl_loss, token_metrics, prox_parts, entropy_parts, grad_norms, stepped = 0.0, 0.0, [], [], [], [], 0
    moved = False  # some optimizer step was taken on a non-zero gradient
    entropy_loss = 0.0  # the entropy bonus's term (algo.entropy_coef), summed like the policy loss
    start_parts = []  # the current pass before the first optimizer update: the step-start policy's logprobs
    learner_parts = []  # the current pass of every row, in the mini-batch that trained it (learner/trust.py)
    for mini in split_minibatches(batch, algo.ppo_minibatches):
        counts = StepCounts(tokens=float(mini.loss_mask.sum()), seqs=float((mini.loss_mask.sum(-1) > 0).sum()))
        mini_loss = 0.0
        for micro in settings.microbatches(mini):
            if micro is None:
                placeholder_pass(model, mini, settings)
                continue
            pg_share, kl_share, entropy_share, metrics, prox, entropy, current = forward_backward(
                model, micro.to(settings.parallel.device), plan, algo, counts, settings, generator)
            entropy_loss = entropy_loss + entropy_share
            if not grad_norms and plan.prox_source != PROX_RECOMPUTE:  # else the recomputed π_prox is the start
                start_parts.append((micro.rows, current))
            pg_loss, kl_loss = pg_loss + pg_share, kl_loss + kl_share
            mini_loss = mini_loss + pg_share + algo.kl_loss_coef * kl_share - algo.entropy_coef * entropy_share
            token_metrics.append(metrics)
            prox_parts.append((micro.rows, prox))
            learner_parts.append((micro.rows, current))
            entropy_parts.append((micro.rows, entropy))
        if warmup:  # the critic learns the returns first; the policy stays where it is
            optimizer.zero_grad(set_to_none=True)
            continue
        grad_norm, took = optimizer_step(model, optimizer, scheduler, settings.grad_clip,
                                         losses_finite(float(mini_loss), settings.parallel))
        grad_norms.append(grad_norm)
        stepped += took
        moved = moved or bool(took and grad_norm > 0)
    losses, token_metrics, prox_parts, entropy_parts, start_parts, learner_parts = to_host(
        (pg_loss, kl_loss, entropy_loss), token_metrics, prox_parts, entropy_parts, start_parts, learner_parts)
    (pg_loss, kl_loss, entropy_loss), token_metrics, prox_parts, entropy_parts, start_parts, learner_parts = \
        gather_over_dp(settings.parallel, losses, token_metrics, prox_parts, entropy_parts, start_parts, learner_parts)
    shape = tuple(batch.loss_mask.shape)
    group_abs_diff = compute_group_abs_diff(scatter_rows(shape, learner_parts), batch.logprobs_behav,
                                            batch.loss_mask, [len(group.samples) for group in groups])
    metrics = collect_step_metrics(
        batch, groups, plan, settings, prox=scatter_rows(shape, prox_parts),
        entropy=scatter_rows(shape, entropy_parts), correction_metrics=correction_metrics,
        step_start=step_start_logprobs(batch, plan, shape, start_parts))
    metrics.update(combine_token_metrics(token_metrics))
    metrics.update(kl_metrics)
    if critic is not None:
        metrics.update(value_metrics(batch))
        metrics["critic/warmup"] = float(warmup)
        if stepped or warmup:  # a skipped step moves nothing, the critic included (the batch is quarantined)
            metrics.update(train_critic(critic, batch, algo.ppo_minibatches, settings))
    if prm is not None and prm.cfg.update == "after" and stepped:  # a skipped step moves nothing, the PRM included
        prm_metrics.update(train_prm(prm, batch, len(groups[0].samples), settings))
    metrics.update(prm_metrics)
    minibatches = max(len(grad_norms), 1)
    metrics.update({
        "loss/pg": pg_loss / minibatches,
        "loss/kl": kl_loss / minibatches,
        "loss/entropy": entropy_loss / minibatches,
        "loss/total": (pg_loss + algo.kl_loss_coef * kl_loss - algo.entropy_coef * entropy_loss) / minibatches,
        "policy/grad_norm": sum(grad_norms) / minibatches,
        "policy/lr": scheduler.get_last_lr()[0],
        "learner/skipped_minibatches": float(len(grad_norms) - stepped),
        # no optimizer step was taken: the weights did not move (by choice during the critic's warmup)
        "learner/skipped": float(stepped == 0 and not warmup),
    })
    step_s = time.perf_counter() - started
    metrics["timing/learner/step_s"] = step_s
    metrics["perf/learner/tokens_per_s"] = float(batch.attention_mask.sum()) / step_s
    return StepResult(metrics, stepped=bool(stepped) or warmup, moved=moved, group_abs_diff=group_abs_diff)
