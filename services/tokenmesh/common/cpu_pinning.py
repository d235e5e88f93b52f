"""CPU affinity: a service's threads kept on the cores given to it (off an engine's cores)."""

from __future__ import annotations

import os


def parse_cores(text: str) -> frozenset[int]:
    """Cores from a list such as "1", "1-3" or "0,2-3"; empty: no pinning."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, dash, high = part.partition("-")
        first, last = int(low), int(high if dash else low)
        if first < 0 or last < first:
            raise ValueError(f"{part!r} is not a core or a range of cores")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def known_cores(text: str) -> frozenset[int]:
    """parse_cores, refusing cores this process may not run on (a setting's validator)."""
    cores = parse_cores(text)
    allowed = os.sched_getaffinity(0)
    if not cores <= allowed:
        raise ValueError(
            f"cores {sorted(cores - allowed)} are not among this machine's {sorted(allowed)}"
        )
    return cores


def pin_threads(cores: frozenset[int], process: int | str = "self") -> None:
    """Every thread of a process (this one by default) onto `cores` (threads started later
    inherit it from their starter). A process's affinity is per thread in Linux, so each is
    set; children started before keep theirs, which is how an engine started earlier stays on
    its own cores."""
    if not cores:
        return
    try:
        threads = os.listdir(f"/proc/{process}/task")
    except FileNotFoundError:
        return  # the process ended meanwhile
    for thread in threads:
        try:
            os.sched_setaffinity(int(thread), cores)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
