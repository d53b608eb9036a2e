"""A discrete-event simulation of the loop: generators sampling groups, the buffer's admission rule, the learner.

What is modelled, and why it is enough to size a fleet:

- **Generators.** Each runs up to `slots` groups of `n` samples at once. `engine="shared"`: the engine's
  tokens/s (`gen_tokens_per_s`, measured while busy) is shared by every sequence it is decoding (processor
  sharing: a CPU or a saturated GPU batch). `engine="slots"`: each sequence decodes at `gen_tokens_per_s` on its
  own (a GPU far from saturation; Applied Compute's model). A group is done when its longest sample is, plus
  `group_overhead_s` (reward, transport). With dynamic sampling a done group is dropped with probability
  `filter_frac` (all its rewards equal) and its admission given back, so another starts in its place. A group is
  sampled by the newest published version when it starts (in-flight updates: its staleness counts from its start,
  the version of its oldest token).
- **Admission** is asyncrl's rule, called as the buffer calls it (`buffer/staleness.py::admission_capacity`):
  a group may start while `started < (lead + v + 1) * B`. `admission=False` lets generators run freely, for the
  evicting queue below.
- **The buffer** is FIFO. The learner takes B groups per step, drops a group older than η and gives its admission
  back (`is_too_stale`). `queue_capacity` (groups, 0: none) evicts the oldest waiting group when full:
  Applied Compute's queue-drop, which the closed form (planner/closed_form.py) assumes.
- **The learner** waits for B groups, trains `train_s_per_step + tokens / train_tokens_per_s`, publishes in
  `publish_s`, then the next version is admitted against.

Out: throughput, the staleness distribution of trained groups (by group and by sample), each side's idle
fraction. Deterministic for a seed.
"""
import heapq
import random
from dataclasses import dataclass, field

from asyncrl.buffer.staleness import admission_capacity, group_staleness, is_too_stale


MAX_FILTER_FRAC = 0.99
"""A larger share of dropped groups is not a plan (a hundred sampled per trained) but a broken run or a lying
report: the share measured from a run comes from the generators' own counts."""


@dataclass
class Fleet:
    generators: int = 1
    slots: int = 4
    """Groups a generator runs at once (generator.max_inflight_groups)."""
    n: int = 4
    """Samples per group (rollout.n)."""
    gen_tokens_per_s: float = 1000.0
    """Busy tokens/s of one generator (engine="shared"), or of one sequence (engine="slots")."""
    engine: str = "shared"
    group_overhead_s: float = 0.0
    seq_slots: int = 0
    """Sequences an engine decodes at once (vLLM's max_num_seqs); the rest of its groups' samples wait, and a
    finished sample's slot takes the next one (continuous batching). 0: every sample of a running group decodes.
    With seq_slots set, a generator starts groups while fewer than seq_slots sequences are waiting or running, up
    to `slots` groups."""
    filter_frac: float = 0.0
    """The share of finished groups dynamic sampling drops (algo.dynamic_sampling: all rewards equal); each gives
    its admission back, so the learner's batch waits for another round of sampling."""


@dataclass
class Learner:
    groups_per_step: int = 4
    max_staleness: int = 1
    lead: int | None = None
    """buffer.admission_lead; None: η."""
    train_s_per_step: float = 1.0
    train_tokens_per_s: float = 0.0
    """0: the step time does not grow with the batch's tokens."""
    publish_s: float = 0.0


@dataclass
class Queue:
    admission: bool = True
    capacity: int = 0
    """Groups the buffer keeps; beyond it the oldest is evicted. 0: unbounded."""


@dataclass
class Result:
    steps: int
    wall_s: float
    trained_groups: int
    trained_tokens: int
    trained_samples: int = 0
    staleness: list = field(default_factory=list)  # per trained group
    sample_staleness_mean: float = 0.0
    learner_idle_frac: float = 0.0
    generator_idle_frac: float = 0.0
    dropped_stale: int = 0
    evicted: int = 0
    produced_groups: int = 0
    filtered: int = 0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.trained_samples / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def staleness_mean(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0

    def staleness_hist(self) -> dict:
        out: dict = {}
        for value in self.staleness:
            out[value] = out.get(value, 0) + 1
        return {key: count / len(self.staleness) for key, count in sorted(out.items())}


class _Generator:
    """One engine and its running groups: [id, start version, remaining tokens per sample, total tokens]."""

    def __init__(self, index: int):
        self.index = index
        self.groups: list = []


def simulate(fleet: Fleet, learner: Learner, queue: Queue, lengths, steps: int, seed: int = 0,
             warmup_steps: int = 0) -> Result:
    """Runs until the learner has trained `steps` steps after `warmup_steps` more (not counted). `lengths`:
    callable(rng, n) -> the n completion lengths of one group, in tokens (planner/from_run.py's samplers)."""
    if fleet.engine not in ("shared", "slots"):
        raise ValueError(f"engine must be shared or slots, got {fleet.engine!r}")
    if not 0.0 <= fleet.filter_frac <= MAX_FILTER_FRAC:
        raise ValueError(f"filter_frac must be in [0, {MAX_FILTER_FRAC}], got {fleet.filter_frac}")
    rng = random.Random(seed)
    lead = learner.max_staleness if learner.lead is None else learner.lead
    B = learner.groups_per_step
    gens = [_Generator(i) for i in range(fleet.generators)]
    version = 0
    started = 0
    buffer: list = []  # (group_id, start_version, tokens, n)
    finishing: list = []  # heap of (time, seq, generator index, group): groups in their overhead
    clock = 0.0
    seq = 0
    learner_state = "collect"  # collect | train
    learner_until = 0.0
    batch: list = []
    learner_idle = 0.0
    counted_from = 0.0 if warmup_steps == 0 else None  # when the counted steps start
    counted_gen_busy = 0.0
    result = Result(steps=0, wall_s=0.0, trained_groups=0, trained_tokens=0)
    sample_staleness_sum, sample_count = 0.0, 0
    total_steps = steps + warmup_steps
    done_steps = 0

    def running(gen) -> list:
        """(group, sample index) of the sequences `gen` decodes now: all unfinished ones, or the first seq_slots."""
        active = [(group, index) for group in gen.groups for index, left in enumerate(group[2]) if left > 0]
        return active[: fleet.seq_slots] if fleet.seq_slots else active

    def rate_of(count: int) -> float:
        """Tokens/s each of `count` running sequences gets."""
        if not count:
            return 0.0
        return fleet.gen_tokens_per_s / count if fleet.engine == "shared" else fleet.gen_tokens_per_s

    def wants_group(gen) -> bool:
        if len(gen.groups) >= fleet.slots:
            return False
        if not fleet.seq_slots:
            return True
        unfinished = sum(1 for group in gen.groups for left in group[2] if left > 0)
        return unfinished < fleet.seq_slots

    def start_groups():
        """Admission round-robin over the generators that have room: they all ask as soon as they do."""
        nonlocal started, seq
        asking = [gen for gen in gens if wants_group(gen)]
        while asking:
            for gen in list(asking):
                if queue.admission and admission_capacity(lead, version, B, started) <= 0:
                    return
                started += 1
                seq += 1
                remaining = [max(1, int(length)) for length in lengths(rng, fleet.n)]
                gen.groups.append([seq, version, list(remaining), sum(remaining)])
                if not wants_group(gen):
                    asking.remove(gen)

    while done_steps < total_steps:
        start_groups()
        # the next event: a sequence finishing, a group leaving its overhead, or the learner finishing a step
        next_t = float("inf")
        decoding = [running(gen) for gen in gens]
        for now in decoding:
            if now:
                next_t = min(next_t, clock + min(group[2][index] for group, index in now) / rate_of(len(now)))
        if finishing:
            next_t = min(next_t, finishing[0][0])
        if learner_state == "train":
            next_t = min(next_t, learner_until)
        if next_t == float("inf"):
            raise RuntimeError("the simulated loop is stuck: nothing runs and the learner waits (admission closed "
                               "with an empty buffer)")
        dt = next_t - clock
        for now in decoding:  # advance every decoding sequence
            rate = rate_of(len(now))
            if now and counted_from is not None:  # busy: decoding at least one sequence
                counted_gen_busy += dt
            for group, index in now:
                left = group[2][index] - rate * dt
                group[2][index] = left if left > 1e-9 else 0.0  # the one that ended this event, rounding aside
        if learner_state == "collect" and counted_from is not None:
            learner_idle += dt
        clock = next_t
        for gen in gens:  # groups whose last sample just finished go to their overhead, then the buffer
            for group in [g for g in gen.groups if not any(g[2])]:
                gen.groups.remove(group)
                seq += 1
                heapq.heappush(finishing, (clock + fleet.group_overhead_s, seq, gen.index, group))
        while finishing and finishing[0][0] <= clock + 1e-12:
            _, _, _, group = heapq.heappop(finishing)
            if fleet.filter_frac and rng.random() < fleet.filter_frac:
                result.filtered += counted_from is not None
                if queue.admission:
                    started -= 1
                continue
            result.produced_groups += counted_from is not None
            buffer.append((group[0], group[1], group[3], fleet.n))
            if queue.capacity and len(buffer) > queue.capacity:
                buffer.pop(0)
                result.evicted += 1
                if queue.admission:
                    started -= 1
        if learner_state == "train" and clock >= learner_until - 1e-12:
            version += 1
            done_steps += 1
            learner_state = "collect"
            if done_steps == warmup_steps:
                counted_from = clock
        if learner_state == "collect":
            while buffer and len(batch) < B:
                group = buffer.pop(0)
                if is_too_stale(version, group[1], learner.max_staleness):
                    result.dropped_stale += done_steps >= warmup_steps
                    if queue.admission:
                        started -= 1  # given back: admission reopens for it
                    continue
                batch.append(group)
            if len(batch) == B:
                tokens = sum(group[2] for group in batch)
                train_s = learner.train_s_per_step + (tokens / learner.train_tokens_per_s
                                                      if learner.train_tokens_per_s else 0.0)
                learner_until = clock + train_s + learner.publish_s
                learner_state = "train"
                if done_steps >= warmup_steps:
                    for group in batch:
                        age = group_staleness(version, group[1])
                        result.staleness.append(age)
                        sample_staleness_sum += age * group[3]
                        sample_count += group[3]
                        result.trained_tokens += group[2]
                        result.trained_samples += group[3]
                    result.trained_groups += B
                batch = []
    result.steps = steps
    result.wall_s = clock - (counted_from or 0.0)
    result.sample_staleness_mean = sample_staleness_sum / sample_count if sample_count else 0.0
    result.learner_idle_frac = learner_idle / result.wall_s if result.wall_s else 0.0
    result.generator_idle_frac = 1.0 - counted_gen_busy / (result.wall_s * len(gens)) if result.wall_s else 0.0
    return result
