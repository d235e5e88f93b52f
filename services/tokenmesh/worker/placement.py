"""Where the engine's processes run: all of them on the cores its model runner is bound to."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from pathlib import Path

from tokenmesh.common.cpu_pinning import parse_cores, pin_threads

log = logging.getLogger(__name__)


def descendants(root: int) -> list[int]:
    """Every process below `root` (children, theirs, ...), from /proc. Read here rather than
    with psutil, which the services do not depend on (only the tests and benchmarks do)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Field 4 of stat, after the command name (which may hold spaces and parentheses).
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    waiting = [root]
    while waiting:
        children = parents.get(waiting.pop(), [])
        found.extend(children)
        waiting.extend(children)
    return found


def bound_cores(processes: list[int], machine: frozenset[int]) -> frozenset[int]:
    """The narrowest set of cores any of these processes' main threads is bound to, when it is
    narrower than the machine's: on CPU, the cores vLLM bound its model runner's OpenMP
    threads to (VLLM_CPU_OMP_THREADS_BIND, an explicit list or vLLM's own "auto" choice).
    Empty when nothing is bound (a GPU engine, "nobind")."""
    narrowest = machine
    for process in processes:
        try:
            cores = frozenset(os.sched_getaffinity(process))
        except ProcessLookupError:
            continue
        if len(cores) < len(narrowest):
            narrowest = cores
    return narrowest if narrowest != machine else frozenset()


def place_engine(
    affinity: str = "runner", worker: int | None = None, exclude: Collection[int] = ()
) -> frozenset[int]:
    """Move the engine's unbound processes (vLLM's engine core, which schedules each step and
    then busy-waits for the model runner's result, sched_yield in a loop) onto `affinity`'s
    cores, and return them (empty: nothing moved). The runner keeps the binding vLLM gave it.

    "runner": the runner's own cores. Left where it starts, the engine core spins on the cores
    the mesh runs on and holds their woken threads off for tens of milliseconds
    (docs/performance.md, "Where the first token waits"); on the runner's cores it yields to
    the runner it waits for anyway. A core list: a core of its own, where one can be spared.
    "any": left where it starts. exclude: processes of the worker that are not the engine's
    (its front ends, frontends.py).
    """
    if affinity == "any":
        return frozenset()
    engine = [
        pid
        for pid in descendants(worker if worker is not None else os.getpid())
        if pid not in exclude
    ]
    # Called before the worker pins its own threads: its affinity is still what it may use.
    machine = frozenset(os.sched_getaffinity(0))
    runner = bound_cores(engine, machine)
    cores = runner if affinity == "runner" else parse_cores(affinity)
    if not cores:
        return frozenset()  # nothing bound (a GPU engine, "nobind"): nothing to keep apart
    for process in engine:
        try:
            bound = frozenset(os.sched_getaffinity(process)) != machine
        except ProcessLookupError:
            continue
        if not bound:
            pin_threads(cores, process)
    log.info("engine core processes placed on cores %s", ",".join(map(str, sorted(cores))))
    return cores
