"""The stall watch: stolen time, late wake-ups and kernel lockups, which count as stalls, and
which of those earn a failed test its rerun (the machine's own: steal and lockups)."""

from __future__ import annotations

from pathlib import Path

from tests.stalls import (
    LATE_SECONDS,
    PROC_STAT,
    RERUN_AFTER_STALLED_SECONDS,
    STALL_SECONDS,
    TICKS_PER_SECOND,
    Stall,
    StallWatch,
    describe,
    earns_rerun,
    io_full_seconds,
    kernel_lockups,
    machine_stalls,
    stalled_seconds,
    stolen_seconds,
)

STAT = """cpu  2704524 495 479117 2722566 18304 0 28737 {total} 0 0
cpu0 1282633 278 241399 1433517 5236 0 13618 {cpu0} 0 0
cpu1 1421891 217 237718 1289049 13067 0 15119 {cpu1} 0 0
intr 1 2 3
"""
KERNEL_LOG = """[23126.5] virtio_net virtio0: something else
[23127.1] BUG: workqueue lockup - pool cpus=1 node=0 flags=0x0 nice=0 stuck for 139s!
[23127.1] Showing backtraces of running workers in stalled CPU-bound worker pools:
[23157.8] BUG: workqueue lockup - pool cpus=1 node=0 flags=0x0 nice=0 stuck for 169s!
"""


def stat(cpu0: int, cpu1: int) -> str:
    return STAT.format(total=cpu0 + cpu1, cpu0=cpu0, cpu1=cpu1)


def test_stolen_seconds_reads_each_cpu_not_the_total() -> None:
    stolen = stolen_seconds(stat(200, 400))
    assert stolen == {"cpu0": 200 / TICKS_PER_SECOND, "cpu1": 400 / TICKS_PER_SECOND}


def test_an_interval_counts_as_a_stall_only_past_the_threshold() -> None:
    watch = StallWatch()
    quiet = stolen_seconds(stat(100, 100))
    a_little = int(STALL_SECONDS * TICKS_PER_SECOND) - 1
    watch.sample(quiet, stolen_seconds(stat(100 + a_little, 100)), now=10.0)
    assert watch.since(0.0) == []
    three_minutes = 180 * TICKS_PER_SECOND
    watch.sample(quiet, stolen_seconds(stat(100, 100 + three_minutes)), now=20.0)
    (stall,) = watch.since(0.0)
    assert (stall.source, stall.seconds) == ("steal cpu1", 180.0)
    assert watch.since(20.5) == []


def test_a_late_wake_up_counts_past_its_threshold() -> None:
    watch = StallWatch(every=0.5)
    watch.woke(0.5 + LATE_SECONDS - 0.01, now=1.0)
    assert watch.since(0.0) == []
    watch.woke(0.5 + 240, now=2.0)
    assert [(s.source, s.seconds) for s in watch.since(0.0)] == [("late wake-up", 240.0)]


def test_only_new_kernel_lockups_count_with_the_longest_stuck_time() -> None:
    assert kernel_lockups(KERNEL_LOG) == [(23127.1, 139), (23157.8, 169)]
    watch = StallWatch()
    seen = watch.kernel(0.0, KERNEL_LOG.splitlines()[0], now=1.0)
    assert seen == 0.0 and watch.since(0.0) == []
    seen = watch.kernel(seen, KERNEL_LOG, now=2.0)
    assert seen == 23157.8
    assert [(s.source, s.seconds) for s in watch.since(0.0)] == [("kernel lockup", 169.0)]
    assert watch.kernel(seen, KERNEL_LOG, now=3.0) == seen and len(watch.since(0.0)) == 1
    # The ring buffer dropped the older line: the newer one is not counted again.
    rotated = KERNEL_LOG.splitlines()[-1]
    assert watch.kernel(seen, rotated, now=4.0) == seen and len(watch.since(0.0)) == 1


def test_stalled_seconds_sums_steal_but_not_repeated_reports() -> None:
    stalls = [
        Stall(1.0, "steal cpu0", 0.5),
        Stall(1.5, "steal cpu1", 0.75),
        Stall(2.0, "kernel lockup", 30.0),
        Stall(2.0, "late wake-up", 45.0),
    ]
    assert stalled_seconds(stalls) == 30.0
    assert stalled_seconds(stalls[:2]) == 1.25
    assert describe(stalls) == (
        "the machine stalled for 30.0 s in all: steal cpu0 0.5 s, steal cpu1 0.75 s, "
        "kernel lockup 30.0 s; also seen (load, the tests' own included): late wake-up 45.0 s"
    )


def test_a_late_wake_up_or_io_stall_alone_earns_no_rerun() -> None:
    """What the code under test can cause itself (a regression hogging the CPUs or the disk)
    never excuses its failure, however long."""
    load = [Stall(1.0, "late wake-up", 240.0), Stall(1.5, "io stall", 154.0)]
    assert stalled_seconds(load) == 0.0
    assert not earns_rerun(load)
    assert describe(load).startswith("the machine stalled for 0.0 s in all: none; also seen")


def test_stolen_time_or_a_kernel_lockup_earns_a_rerun() -> None:
    half = RERUN_AFTER_STALLED_SECONDS / 2
    assert earns_rerun([Stall(1.0, "steal cpu0", half), Stall(1.5, "steal cpu1", half)])
    assert not earns_rerun([Stall(1.0, "steal cpu0", half - 0.01), Stall(1.5, "steal cpu1", half)])
    assert earns_rerun([Stall(1.0, "kernel lockup", 23.0), Stall(1.0, "late wake-up", 23.0)])


def test_machine_stalls_reports_the_steal_and_lockups_within_the_block(tmp_path: Path) -> None:
    proc_stat = tmp_path / "stat"
    log = KERNEL_LOG.splitlines()[0]
    proc_stat.write_text(stat(100, 100))
    with machine_stalls(proc_stat, kernel_log=lambda: log) as quiet:
        proc_stat.write_text(stat(100 + int(STALL_SECONDS * TICKS_PER_SECOND) - 1, 100))
    assert quiet == []
    with machine_stalls(proc_stat, kernel_log=lambda: log) as stolen:
        proc_stat.write_text(stat(100, 100 + 2 * TICKS_PER_SECOND))
    assert [(s.source, s.seconds) for s in stolen] == [("steal cpu1", 2.0)]
    with machine_stalls(proc_stat, kernel_log=lambda: log) as locked:
        log = KERNEL_LOG
    assert [(s.source, s.seconds) for s in locked] == [("kernel lockup", 169.0)]
    # A lockup the kernel reported before the block began is not the block's.
    with machine_stalls(proc_stat, kernel_log=lambda: log) as later:
        pass
    assert later == []


def test_the_watch_reads_this_machine() -> None:
    assert StallWatch().available
    assert set(stolen_seconds(PROC_STAT.read_text())) >= {"cpu0"}


def test_io_stalls_come_from_the_full_line_of_io_pressure() -> None:
    pressure = (
        "some avg10=0.00 avg60=0.00 avg300=0.06 total=210490544\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=154529271\n"
    )
    assert io_full_seconds(pressure) == 154.529271
    assert io_full_seconds("") == 0.0
    watch = StallWatch()
    watch.io(154.0, 154.0 + STALL_SECONDS - 0.01, now=1.0)
    assert watch.since(0.0) == []
    watch.io(154.0, 160.0, now=2.0)
    assert [(s.source, s.seconds) for s in watch.since(0.0)] == [("io stall", 6.0)]
