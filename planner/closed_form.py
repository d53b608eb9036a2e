"""Applied Compute's closed form for the mean staleness of fully asynchronous RL ("Predicting and Controlling
Staleness in Fully Asynchronous RL Training", 2026), the second reference `asyncrl plan` is checked against.

Its setting: rollout engines with C concurrent sample slots and in-flight weight updates, a queue that keeps at
most q·B completed groups and evicts the oldest (queue-drop), a trainer taking B samples per step. Staleness of a
group = trainer steps between the start of its generation and its training. With ρ = rollout throughput / trainer
throughput and M_tail = E[max of a group's lengths] / E[length]:

    pre-queue  PQS = C·M_tail / (B·max(1, ρ))
    in-queue   IQS = ρ                    (ρ < 1: the trainer drains the queue every step)
                     (2q + ρ − 1) / (2ρ)   (ρ > 1: the queue stays full)

The formulas come from secondary sources that cite the post and agree with one another (its first section is the
only part read first-hand); docs/planner.md says which.
"""


def pre_queue_staleness(concurrency: float, batch_samples: float, rho: float, tailness: float) -> float:
    return concurrency * tailness / (batch_samples * max(1.0, rho))


def in_queue_staleness(rho: float, queue_factor: float) -> float:
    if rho < 1:
        return rho
    return (2 * queue_factor + rho - 1) / (2 * rho)


def mean_staleness(concurrency: float, batch_samples: float, rho: float, tailness: float,
                   queue_factor: float) -> float:
    """PQS + IQS. At ρ = 1 exactly the in-queue branches disagree (1 against q); the formula is for ρ ≠ 1."""
    if rho <= 0:
        raise ValueError(f"utilization must be > 0, got {rho}")
    return pre_queue_staleness(concurrency, batch_samples, rho, tailness) + in_queue_staleness(rho, queue_factor)


def tailness(groups: list) -> float:
    """M_tail from groups of completion lengths: the mean of each group's longest over the mean length."""
    lengths = [length for group in groups for length in group]
    if not lengths:
        raise ValueError("no lengths to measure the tailness of")
    mean = sum(lengths) / len(lengths)
    return sum(max(group) for group in groups if group) / sum(1 for group in groups if group) / mean
