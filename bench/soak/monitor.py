"""Leaks and hangs, measured: every process of the soak is sampled (resident memory with its children, open file
descriptors) through the run, and a step that takes longer than the soak's bound becomes a failure with every
process's stack dumped.

Why the slope of the last half: a process grows while it starts (imports, the model, the engine's buffers, the
first compiled kernels), so the first half says little; a leak is memory that keeps growing once the process is
warm. A process restarted by a fault starts a new life: the slope is of its longest life's last half, where it had
the most time to warm, and the report gives the life it was measured on.
"""
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil


@dataclass
class Life:
    """One process life of a role (a restart starts another): its samples (seconds since the soak's start,
    resident bytes of the process and its children, open file descriptors of the process)."""
    pid: int
    times: list = field(default_factory=list)
    rss: list = field(default_factory=list)
    fds: list = field(default_factory=list)


def slope_per_min(times: list, values: list) -> float | None:
    """The least-squares slope of values over times (seconds), per minute; None with under three points."""
    if len(times) < 3:
        return None
    mean_t, mean_v = sum(times) / len(times), sum(values) / len(values)
    spread = sum((t - mean_t) ** 2 for t in times)
    if spread == 0:
        return None
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / spread


def last_half_slope(life: Life) -> float | None:
    """MB per minute over the last half of the life's span."""
    if not life.times:
        return None
    middle = (life.times[0] + life.times[-1]) / 2
    kept = [(t, r) for t, r in zip(life.times, life.rss) if t >= middle]
    return slope_per_min([t for t, _ in kept], [r / 2 ** 20 for _, r in kept])


def tree_usage(pid: int) -> tuple[int, int] | None:
    """(resident bytes of the process and its children, open fds of the process), None when it is gone."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped: nothing of it is in use
            return None
        rss = process.memory_info().rss
        for child in process.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:
                pass
        return rss, process.num_fds()
    except psutil.Error:
        return None


class ProcessMonitor:
    """Per role (learner, gen-0, redis, ...), the lives of its processes, sampled by `sample()`."""

    def __init__(self):
        self.started = time.monotonic()
        self.roles: dict = {}

    def watch(self, role: str, pid: int) -> None:
        """`pid` is now the role's process (its first, or a restart's)."""
        lives = self.roles.setdefault(role, [])
        if not lives or lives[-1].pid != pid:
            lives.append(Life(pid))

    def sample(self) -> None:
        now = time.monotonic() - self.started
        for lives in self.roles.values():
            usage = tree_usage(lives[-1].pid)
            if usage is not None:
                lives[-1].times.append(now)
                lives[-1].rss.append(usage[0])
                lives[-1].fds.append(usage[1])

    def report(self) -> dict:
        """role -> the figures of its longest life (the one with the most time to show a leak): RSS at its start
        and end (MB), the last half's slope (MB/min), fds at its start and end, and the number of lives."""
        out = {}
        for role, lives in self.roles.items():
            sampled = [life for life in lives if life.times]
            if not sampled:
                continue
            life = max(sampled, key=lambda one: one.times[-1] - one.times[0])
            out[role] = {"lives": len(lives), "pid": life.pid, "span_s": round(life.times[-1] - life.times[0], 1),
                         "rss_start_mb": round(life.rss[0] / 2 ** 20, 1), "rss_end_mb": round(life.rss[-1] / 2 ** 20, 1),
                         "rss_slope_mb_per_min": last_half_slope(life), "fds_start": life.fds[0],
                         "fds_end": life.fds[-1], "fds_max": max(life.fds)}
        return out


def dump_stacks(pids: dict, path: str) -> str:
    """Every process's Python stacks (py-spy dump; it reads them from outside, no cooperation needed) into `path`,
    for a hang: role -> pid. Returns the path."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(os.path.realpath(sys.executable)), "py-spy")
    with open(path, "w") as out:
        for role, pid in pids.items():
            out.write(f"===== {role} (pid {pid}) =====\n")
            out.flush()
            if not os.path.exists(spy):
                out.write("py-spy is not installed: no stack\n")
                continue
            done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            out.write(done.stdout + done.stderr + "\n")
    return path
