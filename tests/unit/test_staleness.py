"""Property test of DESIGN.md §4: whatever the delays, no trained group exceeds η."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.buffer.staleness import Coordinator, admission_capacity, group_staleness, is_too_stale


def test_admission_capacity_formula():
    assert admission_capacity(max_staleness=2, version=0, groups_per_step=4, started=0) == 12
    assert admission_capacity(2, 3, 4, 20) == 4
    assert admission_capacity(0, 0, 4, 4) == 0
    assert admission_capacity(0, 1, 4, 4) == 4


def test_staleness_boundary_is_inclusive_of_eta():
    assert group_staleness(5, 3) == 2
    assert not is_too_stale(5, 3, max_staleness=2)
    assert is_too_stale(5, 2, max_staleness=2)


def test_departed_generator_gives_back_its_admissions():
    coord = Coordinator(max_staleness=0, groups_per_step=2)
    assert coord.try_admit("a", 2) == 2 and coord.try_admit("b", 1) == 0
    assert coord.forget_generator("a") == 2
    assert coord.try_admit("b", 2) == 2


def simulate(seed: int, eta: int, groups_per_step: int, generators: int, steps: int, max_delay: int,
             in_order: bool) -> tuple[list, int]:
    """A discrete-time simulation of generators and the learner with random sampling delays.

    Generators load the newest published version before sampling (DESIGN.md §4); groups complete after a random
    delay; the learner takes groups as they complete, drops stale ones, and publishes after each step.
    Returns the staleness of every trained group and the number dropped.
    """
    rng = random.Random(seed)
    coord = Coordinator(eta, groups_per_step)
    version, in_flight, arrived, trained, dropped, t = 0, [], [], [], 0, 0
    busy = {g: 0 for g in range(generators)}
    while version < steps and t < 100_000:
        t += 1
        for gen in range(generators):
            if busy[gen] < 4 and coord.try_admit(str(gen)):
                delay = 1 + (rng.randrange(max_delay) if not in_order else 0)
                in_flight.append((t + delay, gen, coord.version))
                busy[gen] += 1
        for item in [i for i in in_flight if i[0] <= t]:
            in_flight.remove(item)
            busy[item[1]] -= 1
            coord.delivered(str(item[1]))
            arrived.append(item[2])
        while len(arrived) >= groups_per_step or (arrived and rng.random() < 0.5):
            batch = []
            while arrived and len(batch) < groups_per_step:
                behav = arrived.pop(0)
                if is_too_stale(version, behav, eta):
                    dropped += 1
                    coord.give_back(1)
                    continue
                batch.append(group_staleness(version, behav))
            if len(batch) < groups_per_step:
                arrived = [version - s for s in batch] + arrived  # not a full batch yet: put them back
                break
            trained.extend(batch)
            version += 1
            coord.set_version(version)
    return trained, dropped


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 4), groups_per_step=st.integers(1, 6),
       generators=st.integers(1, 4), max_delay=st.integers(1, 12))
def test_no_trained_group_ever_exceeds_eta(seed, eta, groups_per_step, generators, max_delay):
    trained, _ = simulate(seed, eta, groups_per_step, generators, steps=15, max_delay=max_delay, in_order=False)
    assert trained, "the simulation trained nothing"
    assert max(trained) <= eta


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 4), groups_per_step=st.integers(1, 6),
       generators=st.integers(1, 4))
def test_pacing_drops_nothing_when_groups_complete_in_admission_order(seed, eta, groups_per_step, generators):
    """η = 0 is synchronous on-policy training: admission alone keeps every group fresh, none is wasted."""
    trained, dropped = simulate(seed, eta, groups_per_step, generators, steps=15, max_delay=1, in_order=True)
    assert dropped == 0 and max(trained) <= eta and len(trained) >= 15 * groups_per_step
