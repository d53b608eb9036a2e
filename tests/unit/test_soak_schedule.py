"""The soak's fault schedule (bench/soak/schedule.py) and its leak arithmetic (bench/soak/monitor.py): pure
functions, no processes but the test's own."""
import os

import pytest

from asyncrl.bench.soak.monitor import Life, ProcessMonitor, last_half_slope, slope_per_min
from asyncrl.bench.soak.schedule import GENERATOR_FAULTS, make_schedule

GENS = ["gen-0", "gen-1"]


def test_a_schedule_is_its_seed_spread_apart_and_inside_the_window():
    counts = {"kill_generator": 2, "stop_generator": 1, "kill_learner": 1, "partition": 1, "hostile": 2}
    durations = {"stop_generator": 20.0, "partition": 15.0}
    faults = make_schedule(7, 600.0, counts, GENS, warmup_s=60.0, cooldown_s=90.0, durations=durations)
    assert faults == make_schedule(7, 600.0, counts, GENS, 60.0, 90.0, durations)  # replayable
    assert faults != make_schedule(8, 600.0, counts, GENS, 60.0, 90.0, durations)
    assert sorted(f.kind for f in faults) == sorted(k for k, n in counts.items() for _ in range(n))
    assert all(60.0 <= f.at_s and f.at_s + f.duration_s <= 510.0 for f in faults)
    assert all(a.at_s + a.duration_s <= b.at_s for a, b in zip(faults, faults[1:]))  # none overlaps the next
    assert all((f.target in GENS) == (f.kind in GENERATOR_FAULTS) for f in faults)
    assert {f.target for f in faults if f.kind == "kill_learner"} == {"learner"}


def test_a_schedule_that_cannot_fit_or_names_an_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="run longer or inject fewer"):
        make_schedule(0, 100.0, {"stop_generator": 3}, GENS, 20.0, 20.0, {"stop_generator": 30.0})
    with pytest.raises(ValueError, match="unknown fault kinds"):
        make_schedule(0, 100.0, {"unplug": 1}, GENS, 0.0, 0.0, {})
    assert make_schedule(0, 100.0, {}, GENS, 0.0, 0.0, {}) == []


def test_the_slope_is_of_the_last_half_in_mb_per_minute():
    assert slope_per_min([0.0, 60.0, 120.0], [1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert slope_per_min([0.0, 1.0], [1.0, 2.0]) is None
    # grows 100 MB while warming, then flat: no leak
    life = Life(1, times=[0, 30, 60, 90, 120, 150], rss=[x * 2 ** 20 for x in (100, 200, 200, 200, 200, 200)])
    assert last_half_slope(life) == pytest.approx(0.0)
    leaking = Life(1, times=[0, 60, 120, 180, 240, 300], rss=[x * 2 ** 20 for x in (100, 110, 120, 130, 140, 150)])
    assert last_half_slope(leaking) == pytest.approx(10.0)


def test_the_monitor_samples_a_live_process_and_starts_a_life_per_restart():
    monitor = ProcessMonitor()
    monitor.watch("me", os.getpid())
    for _ in range(3):
        monitor.sample()
    monitor.watch("me", os.getpid())  # the same process: the same life
    report = monitor.report()["me"]
    assert report["lives"] == 1 and report["rss_end_mb"] > 10 and report["fds_end"] >= 3
    monitor.watch("me", 2 ** 22 + 1)  # a restart whose process is gone before it is sampled
    monitor.sample()
    assert monitor.report()["me"]["lives"] == 2 and monitor.report()["me"]["pid"] == os.getpid()


def test_a_row_written_before_a_fault_ended_is_not_its_recovery(tmp_path):
    """The hour soak read 0.4 s from a learner's kill to its "next step": a row the killed learner wrote just before
    dying, polled after the fault's end. A recovery is the first row past those in the file when the fault ended."""
    from asyncrl.bench.soak.monitor import ProcessMonitor
    from asyncrl.bench.soak.run import StepWatch

    watch = StepWatch(str(tmp_path), ProcessMonitor())
    (tmp_path / "progress.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3')  # the last row half-written
    assert watch.rows_now() == 2
    watch.seen = [(10.0, 1), (10.4, 2), (25.0, 3)]  # row 2 polled at 10.4, after the fault ended at 10.0
    assert watch.next_step_after(10.0, rows_then=2) == 15.0
    assert watch.next_step_after(10.0, rows_then=1) == pytest.approx(0.4) and watch.next_step_after(30.0, rows_then=2) is None


def test_the_full_disk_fault_fills_a_filesystem_to_the_brim_whatever_was_written_meanwhile(tmp_path):
    """The hour soak's driver died of ENOSPC: it allocated the free space it had measured a moment before, and the
    learner had written in between. Here a small tmpfs when the test may mount one, else the test's own disk."""
    import shutil as shell
    import subprocess

    from asyncrl.bench.soak.run import fill

    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(tmp_path)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("needs root to mount a small tmpfs (CI has it)")
    try:
        (tmp_path / "checkpoint").write_bytes(b"x" * (3 << 20))
        path = fill(str(tmp_path))
        assert shell.disk_usage(str(tmp_path)).free < 8192
        with pytest.raises(OSError):
            with open(tmp_path / "more", "wb") as handle:
                handle.write(b"y" * (1 << 20))
                handle.flush()
                os.fsync(handle.fileno())
        os.remove(path)
    finally:
        subprocess.run(["umount", str(tmp_path)], capture_output=True)
