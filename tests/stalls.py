"""The machine's stalls: CPU time the VM lost (steal time), kernel lockups, and, as information
only, late wake-ups and I/O stalls."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# Pressure stall information: time in which every runnable task waited on I/O ("full").
IO_PRESSURE = Path("/proc/pressure/io")
# Sampled this often; a stall shows as one interval that lost a lot.
SAMPLE_SECONDS = 0.5
# Stolen time in one interval that counts as a stall (a quiet VM steals ~0 here).
STALL_SECONDS = 0.25
# A wake-up this late: the VM was paused, or this process got no CPU for that long.
LATE_SECONDS = 1.0
# The kernel's own reports of a CPU that made no progress ("BUG: workqueue lockup - pool
# cpus=1 ... stuck for 169s!", "soft lockup - CPU#1 stuck for 23s!"), read every this often.
KERNEL_EVERY_SECONDS = 10.0
KERNEL_LOCKUP = re.compile(r"^\[\s*(\d+\.\d+)\].*lockup.*stuck for (\d+)s", re.MULTILINE)
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
# A failed integration test runs once more if the machine itself stalled this long while it ran
# (tests/conftest.py): its processes are pinned to cores, and a stall of one stops them as long.
RERUN_AFTER_STALLED_SECONDS = 1.0


def stolen_seconds(stat: str) -> dict[str, float]:
    """Each CPU's steal time (the eighth value of its cpuN line), in seconds."""
    stolen = {}
    for line in stat.splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name != "cpu" and len(values) >= 8:
            stolen[name] = int(values[7]) / TICKS_PER_SECOND
    return stolen


def io_full_seconds(pressure: str) -> float:
    """The "full" total of /proc/pressure/io, in seconds (0 without PSI)."""
    for line in pressure.splitlines():
        if line.startswith("full "):
            fields = dict(field.split("=", 1) for field in line.split()[1:])
            return int(fields.get("total", "0")) / 1e6
    return 0.0


def read_io_pressure(path: Path = IO_PRESSURE) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def kernel_lockups(log: str) -> list[tuple[float, int]]:
    """Each lockup the kernel log reports: its kernel timestamp and the seconds stuck."""
    return [(float(found[1]), int(found[2])) for found in KERNEL_LOCKUP.finditer(log)]


def newest_lockup(log: str) -> float:
    """The kernel timestamp of the newest lockup in the log (0 without one)."""
    return max([0.0, *(at for at, _ in kernel_lockups(log))])


def read_kernel_log() -> str:
    """The kernel's ring buffer (dmesg needs root or CAP_SYSLOG; without them: nothing)."""
    try:
        return subprocess.run(
            ["dmesg"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


@dataclass(frozen=True)
class Stall:
    ended: float  # time.monotonic() when it was seen
    source: str  # "steal cpuN", "io stall", "late wake-up" or "kernel lockup"
    seconds: float

    @property
    def machine(self) -> bool:
        """Stolen time or a kernel lockup: the machine's own, which no code under test can
        cause. A late wake-up or an I/O stall it can (a regression that hogs the CPUs or the
        disk), so those are reported but never excuse a failure."""
        return self.source.startswith("steal") or self.source == "kernel lockup"


class StallWatch:
    """A daemon thread that records the moments this VM lost its CPUs: a CPU stolen by the
    hypervisor for STALL_SECONDS or more within one interval, or a new lockup in the kernel's
    log (Stall.machine); and, as information for a failure's report, every task waiting on
    I/O that long or the thread itself waking LATE_SECONDS or more late, which the tests' own
    load causes too (docs/testing.md)."""

    def __init__(
        self,
        stat: Path = PROC_STAT,
        every: float = SAMPLE_SECONDS,
        kernel_log: Callable[[], str] = read_kernel_log,
    ) -> None:
        self._stat = stat
        self._every = every
        self._kernel_log = kernel_log
        self._stalls: list[Stall] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    @property
    def available(self) -> bool:
        return self._stat.exists()

    def start(self) -> None:
        if self.available:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def record(self, stall: Stall) -> None:
        with self._lock:
            self._stalls.append(stall)

    def sample(self, before: dict[str, float], after: dict[str, float], now: float) -> None:
        """Record the CPUs stolen between two readings of stolen_seconds()."""
        for cpu in after:
            stolen = after[cpu] - before.get(cpu, after[cpu])
            if stolen >= STALL_SECONDS:
                self.record(Stall(now, f"steal {cpu}", round(stolen, 2)))

    def io(self, before: float, after: float, now: float) -> None:
        """Record an interval in which every task waited on I/O for STALL_SECONDS or more."""
        if after - before >= STALL_SECONDS:
            self.record(Stall(now, "io stall", round(after - before, 2)))

    def woke(self, slept: float, now: float) -> None:
        """Record a wake-up that came LATE_SECONDS or more after it was due."""
        late = slept - self._every
        if late >= LATE_SECONDS:
            self.record(Stall(now, "late wake-up", round(late, 2)))

    def kernel(self, seen_until: float, log: str, now: float) -> float:
        """Record the lockups the kernel reported after its timestamp `seen_until` (by time,
        not position: the ring buffer drops its oldest lines); the newest timestamp seen."""
        reported = kernel_lockups(log)
        new = [stuck for at, stuck in reported if at > seen_until]
        if new:
            self.record(Stall(now, "kernel lockup", float(max(new))))
        return max([seen_until, *(at for at, _ in reported)])

    def since(self, begun: float) -> list[Stall]:
        """The stalls seen after time.monotonic() was `begun`."""
        with self._lock:
            return [stall for stall in self._stalls if stall.ended >= begun]

    def _run(self) -> None:
        before = stolen_seconds(self._stat.read_text())
        io_before = io_full_seconds(read_io_pressure())
        # Lockups reported before the watch began are not this run's.
        lockups = newest_lockup(self._kernel_log())
        last = kernel_checked = time.monotonic()
        while not self._stop.wait(self._every):
            now = time.monotonic()
            self.woke(now - last, now)
            after = stolen_seconds(self._stat.read_text())
            self.sample(before, after, now)
            io_after = io_full_seconds(read_io_pressure())
            self.io(io_before, io_after, now)
            before, io_before, last = after, io_after, now
            if now - kernel_checked >= KERNEL_EVERY_SECONDS:
                lockups = self.kernel(lockups, self._kernel_log(), now)
                kernel_checked = now


def stalled_seconds(stalls: list[Stall]) -> float:
    """How long the machine itself stalled (Stall.machine), by its worse signal: stolen time
    summed over the intervals, or the longest kernel lockup."""
    stolen = sum((s.seconds for s in stalls if s.machine and s.source.startswith("steal")), 0.0)
    lockups = [s.seconds for s in stalls if s.machine and not s.source.startswith("steal")]
    return max([stolen, *lockups])


def earns_rerun(stalls: list[Stall]) -> bool:
    """Whether a failed integration test runs once more after these stalls: the machine itself
    stalled RERUN_AFTER_STALLED_SECONDS or more; late wake-ups and I/O stalls do not count."""
    return stalled_seconds(stalls) >= RERUN_AFTER_STALLED_SECONDS


def describe(stalls: list[Stall]) -> str:
    """The machine's own stalls, their total first, then the other observations."""

    def listed(these: list[Stall]) -> str:
        return ", ".join(f"{s.source} {s.seconds} s" for s in these[:40]) or "none"

    machine = [s for s in stalls if s.machine]
    others = [s for s in stalls if not s.machine]
    text = f"the machine stalled for {stalled_seconds(stalls):.1f} s in all: {listed(machine)}"
    if others:
        text += f"; also seen (load, the tests' own included): {listed(others)}"
    return text


@contextlib.contextmanager
def machine_stalls(
    stat: Path = PROC_STAT, kernel_log: Callable[[], str] = read_kernel_log
) -> Iterator[list[Stall]]:
    """The machine's own stalls while the block ran (a CPU's steal time of STALL_SECONDS or
    more, a new kernel lockup), in the list it gives, filled when the block ends: one round of
    a measurement that such a stall overlapped may be measured again (tests/timing.py)."""
    found: list[Stall] = []
    watch = StallWatch(stat, kernel_log=kernel_log)
    if not watch.available:
        yield found
        return
    stolen, lockups = stolen_seconds(stat.read_text()), newest_lockup(kernel_log())
    yield found
    now = time.monotonic()
    watch.sample(stolen, stolen_seconds(stat.read_text()), now)
    watch.kernel(lockups, kernel_log(), now)
    found.extend(watch.since(0.0))
