"""Property tests of the staleness rule (docs/architecture.md §4), driving the real `Coordinator` and the real
`learner/collect.py::collect_batch` against a faithful fake of the learner's buffer under random delays.

The fake (`SimulatedFleet`) plays the generators in discrete time: each tick every generator asks the coordinator
for admission for each of its free slots, samples an admitted group with the newest published weights (as a real
generator loads them before it starts a group), and delivers it after a random delay. `take` advances time until a
group has arrived. The learner loop around it is the real one's shape: collect a batch, spend some ticks training
(generators keep sampling meanwhile: asynchrony), publish, set the version.

Two bounds are asserted, and the coordinator's accounting (every dropped group gave its admission back):
- nothing trained is ever more than η versions stale (checked from the simulation's own record of the version
  each group was sampled with, not from collect_batch's arithmetic);
- what is dropped stays small: a group admitted at rank r (the coordinator's `started` just before it) while the
  version was v_a can only be dropped after at least (η + v_a + 1)·B - r >= 1 groups admitted AFTER it were
  trained BEFORE it. Consumed in admission order nothing is ever dropped. This is what the admission formula and
  the give-back accounting guarantee; an off-by-one in either breaks it.
"""
import random
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.buffer.staleness import Coordinator, admission_capacity, group_staleness, is_too_stale
from asyncrl.learner.collect import collect_batch


def test_admission_capacity_formula():
    assert admission_capacity(lead=2, published_version=0, groups_per_step=4, started=0) == 12
    assert admission_capacity(2, 3, 4, 20) == 4
    assert admission_capacity(0, 0, 4, 4) == 0
    assert admission_capacity(0, 1, 4, 4) == 4


def test_staleness_boundary_is_inclusive_of_eta():
    assert group_staleness(5, 3) == 2
    assert not is_too_stale(5, 3, max_staleness=2)
    assert is_too_stale(5, 2, max_staleness=2)


def test_departed_generator_gives_back_its_admissions():
    coord = Coordinator(lead=0, groups_per_step=2)
    assert coord.try_admit("a", 2) == 2 and coord.try_admit("b", 1) == 0
    assert coord.forget_generator("a") == 2
    assert coord.try_admit("b", 2) == 2


@dataclass
class Admission:
    index: int  # admission order
    rank: int  # coordinator.started just before it was admitted
    version: int  # the coordinator's (= published) version at admission: the weights it is sampled with
    arrives: int  # tick of delivery


class SimulatedFleet:
    """The learner's buffer (the parts collect_batch uses) in front of simulated generators."""

    def __init__(self, coordinator: Coordinator, rng: random.Random, generators: int, slots: int, max_delay: int,
                 in_order: bool, max_ticks: int = 20_000):
        self.coordinator, self.rng = coordinator, rng
        self.generators, self.slots, self.max_delay, self.in_order = generators, slots, max_delay, in_order
        self.max_ticks = max_ticks
        self.tick = 0
        self.busy = [0] * generators
        self.in_flight: list[tuple[int, Group]] = []
        self.arrived: list[Group] = []
        self.admissions: dict[str, Admission] = {}
        self.given_back: list[str] = []
        self.taken: list[str] = []  # every group take() returned, in order

    # --- what collect_batch calls ---------------------------------------------------------------------------
    def take(self, timeout_s: float):
        while not self.arrived:
            self.advance(1)
        group = self.arrived.pop(0)
        self.taken.append(group.group_id)
        return group

    def give_back(self, group: Group, reason: str = "stale") -> None:
        self.given_back.append(group.group_id)
        self.coordinator.give_back(1, token=group.group_id)

    def live_generators(self) -> list[str]:
        return [str(g) for g in range(self.generators)]

    def metrics(self) -> dict:
        return {}  # the simulated fleet filters nothing before sending

    # --- the generators --------------------------------------------------------------------------------------
    def advance(self, ticks: int) -> None:
        for _ in range(ticks):
            self.tick += 1
            assert self.tick < self.max_ticks, "the fleet stalled: admission never reopened (capacity leaked)"
            for gen in range(self.generators):
                while self.busy[gen] < self.slots:
                    rank = self.coordinator.started
                    if not self.coordinator.try_admit(str(gen)):
                        break
                    self.busy[gen] += 1
                    self._start(gen, rank)
            landed = [item for item in self.in_flight if item[0] <= self.tick]
            self.rng.shuffle(landed)  # groups landing in the same tick arrive in any order
            for item in landed:
                self.in_flight.remove(item)
                group = item[1]
                gen = int(group.generator_id)
                self.busy[gen] -= 1
                self.coordinator.delivered(group.generator_id)
                self.arrived.append(group)

    def _start(self, gen: int, rank: int) -> None:
        index = len(self.admissions)
        delay = 1 if self.in_order else 1 + self.rng.randrange(self.max_delay)
        version = self.coordinator.version  # the newest published weights: loaded before sampling
        group = Group(group_id=f"g{index}", prompt_id=str(index), generator_id=str(gen),
                      prompt_ids=np.array([1], np.int32),
                      samples=[Sample(completion_ids=np.array([2], np.int32), logprobs=np.array([-1.0], np.float32),
                                      versions=np.array([version], np.int32), reward=0.0, finish_reason="stop")],
                      sampling=Sampling(temperature=1.0), created_at=0.0)
        self.admissions[group.group_id] = Admission(index, rank, version, self.tick + delay)
        self.in_flight.append((self.tick + delay, group))


def simulate(seed: int, eta: int, groups_per_step: int, generators: int, steps: int, max_delay: int,
             in_order: bool, max_train_ticks: int = 3, lead: int | None = None, publish_every: int = 1):
    """Runs `steps` learner steps; returns (fleet, [(group id, trained version it was trained at)], dropped
    groups). `lead`: the admission lead (buffer.admission_lead), η when None. `publish_every`:
    weightsync.every_steps, so the published version the coordinator paces by lags the trained one."""
    rng = random.Random(seed)
    coordinator = Coordinator(eta if lead is None else lead, groups_per_step)
    fleet = SimulatedFleet(coordinator, rng, generators, slots=4, max_delay=max_delay, in_order=in_order)
    trained, dropped = [], []
    for version in range(steps):
        collected = collect_batch(fleet, groups_per_step, eta, version, timeout_s=3600.0)
        assert len(collected.groups) == groups_per_step
        trained += [(group.group_id, version) for group in collected.groups]
        dropped += [(group_id, version) for group_id in fleet.given_back[len(dropped):]]
        fleet.advance(1 if in_order else 1 + rng.randrange(max_train_ticks))  # training: generators keep going
        if (version + 1) % publish_every == 0:
            coordinator.set_version(version + 1)  # published
    return fleet, trained, dropped


def assert_bounds(fleet, trained, dropped, eta, groups_per_step):
    # every admission is accounted for: trained, in flight, or waiting; a dropped group gave its admission back
    assert fleet.coordinator.started == len(trained) + len(fleet.in_flight) + len(fleet.arrived)
    for group_id, version in trained:
        assert version - fleet.admissions[group_id].version <= eta, (group_id, version)
    trained_ids = {group_id for group_id, _ in trained}
    for group_id, version in dropped:
        admitted = fleet.admissions[group_id]
        assert version - admitted.version > eta  # it really was too stale
        before = fleet.taken[:fleet.taken.index(group_id)]
        overtakers = [g for g in before if g in trained_ids and fleet.admissions[g].index > admitted.index]
        required = (eta + admitted.version + 1) * groups_per_step - admitted.rank
        assert required >= 1 and len(overtakers) >= required, (group_id, admitted, len(overtakers), required)


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 4), groups_per_step=st.integers(1, 6),
       generators=st.integers(1, 4), max_delay=st.integers(1, 12))
def test_no_trained_group_exceeds_eta_and_drops_need_overtaking(seed, eta, groups_per_step, generators, max_delay):
    fleet, trained, dropped = simulate(seed, eta, groups_per_step, generators, steps=15, max_delay=max_delay,
                                       in_order=False)
    assert len(trained) == 15 * groups_per_step
    assert_bounds(fleet, trained, dropped, eta, groups_per_step)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 4), groups_per_step=st.integers(1, 6),
       generators=st.integers(1, 4))
def test_pacing_drops_nothing_when_groups_complete_in_admission_order(seed, eta, groups_per_step, generators):
    """η = 0 is synchronous on-policy training: admission alone keeps every group fresh, none is wasted."""
    fleet, trained, dropped = simulate(seed, eta, groups_per_step, generators, steps=15, max_delay=1, in_order=True)
    assert dropped == [] and len(trained) == 15 * groups_per_step
    assert_bounds(fleet, trained, dropped, eta, groups_per_step)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), eta=st.integers(1, 4), gap=st.integers(1, 4), groups_per_step=st.integers(1, 6),
       generators=st.integers(1, 4), max_delay=st.integers(1, 12))
def test_an_admission_lead_below_eta_paces_the_fleet_and_keeps_every_bound(seed, eta, gap, groups_per_step,
                                                                           generators, max_delay):
    """buffer.admission_lead = L < η: in admission order nothing is staler than L and nothing is dropped; with any
    delays nothing trained exceeds η, and every drop still needed the overtaking the η bound implies."""
    lead = max(0, eta - gap)
    fleet, trained, dropped = simulate(seed, eta, groups_per_step, generators, steps=15, max_delay=1, in_order=True,
                                       lead=lead)
    assert dropped == [] and len(trained) == 15 * groups_per_step
    assert max(version - fleet.admissions[group_id].version for group_id, version in trained) <= lead
    fleet, trained, dropped = simulate(seed, eta, groups_per_step, generators, steps=15, max_delay=max_delay,
                                       in_order=False, lead=lead)
    assert len(trained) == 15 * groups_per_step
    assert_bounds(fleet, trained, dropped, eta, groups_per_step)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), eta=st.integers(0, 4), groups_per_step=st.integers(1, 6),
       generators=st.integers(1, 4), max_delay=st.integers(1, 12), data=st.data())
def test_publishing_every_k_steps_admits_by_the_published_version_and_keeps_the_trained_bound(
        seed, eta, groups_per_step, generators, max_delay, data):
    """weightsync.every_steps = k <= η + 1 (the config's rule): admission waits for the published version, which
    lags the trained one by up to k - 1, so the fleet only runs less far ahead; staleness, measured against the
    trained version, stays within η, and in admission order nothing is dropped."""
    every = data.draw(st.integers(1, eta + 1))
    fleet, trained, dropped = simulate(seed, eta, groups_per_step, generators, steps=15, max_delay=1, in_order=True,
                                       publish_every=every)
    assert dropped == [] and len(trained) == 15 * groups_per_step
    assert fleet.coordinator.version == 15 - 15 % every  # the published version, not the trained 15
    fleet, trained, dropped = simulate(seed, eta, groups_per_step, generators, steps=15, max_delay=max_delay,
                                       in_order=False, publish_every=every)
    assert len(trained) == 15 * groups_per_step
    assert_bounds(fleet, trained, dropped, eta, groups_per_step)


def test_a_generator_releases_only_the_admissions_it_holds():
    """algo.dynamic_sampling: a generator that drops its own zero-variance group gives that admission back at once;
    it can never free capacity it did not take (a hostile count, or another generator's)."""
    coord = Coordinator(lead=0, groups_per_step=4)
    assert coord.try_admit("a", 3) == 3 and coord.try_admit("b", 1) == 1 and coord.try_admit("b", 1) == 0
    assert coord.release("a", 1) == 1 and coord.started == 3 and coord.outstanding() == {"a": 2, "b": 1}
    assert coord.release("a", 100) == 2 and coord.started == 1  # only what it still held
    assert coord.release("a", 1) == 0 and coord.release("nobody", 5) == 0 and coord.release("b", -3) == 0
    assert coord.started == 1 and coord.try_admit("c", 10) == 3
    coord.delivered("b")
    assert coord.release("b", 1) == 0  # delivered: no longer held
