"""Where a process's wall time goes: busy or idle. The generator reports `timing/generator/idle_frac` from a
BusyClock (generator/rollout.py), the learner `timing/learner/idle_frac` from its wait for each batch
(learner/host.py); together they show how much the two sides overlap. Stdlib only."""
import time


class BusyClock:
    """Wall time during which at least one piece of work was running (the generator: sampling a group, or loading
    weights), however many overlap. What is left of the wall time is idle: waiting for admission or the learner."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.active = 0
        self.busy_s = 0.0
        self._since = 0.0

    def __enter__(self):
        if self.active == 0:
            self._since = self.clock()
        self.active += 1
        return self

    def __exit__(self, *exc):
        self.active -= 1
        if self.active == 0:
            self.busy_s += self.clock() - self._since

    def total(self) -> float:
        """Busy seconds so far, the running stretch included."""
        return self.busy_s + (self.clock() - self._since if self.active else 0.0)


def share(part_s: float, wall_s: float) -> float:
    """part / wall, clamped into [0, 1] (clocks read at slightly different moments can overshoot); 0 for an empty
    window."""
    if wall_s <= 0:
        return 0.0
    return min(max(part_s / wall_s, 0.0), 1.0)


def idle_fraction(busy_s: float, wall_s: float) -> float:
    """The share of a window not spent busy; 0 for an empty window."""
    return 1.0 - share(busy_s, wall_s) if wall_s > 0 else 0.0
