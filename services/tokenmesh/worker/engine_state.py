"""What the worker knows of its engine between requests: the scheduler's latest report and the
time of its last step. With several front ends over one engine (frontends > 1) both live in
shared memory: vLLM sends each step's report to one front end only, and every front end must
see every step (for its load reports, its admission and its stall watchdog)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import MutableSequence
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from typing import Any

# EngineLoad's whole numbers, in this order in its memory.
_INTS = (
    "running",
    "waiting",
    "reported_unix_nanos",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


class EngineLoad:
    """The scheduler's latest report: what vLLM itself says is running and waiting, the KV
    cache's use, and the prompt tokens looked up in the prefix cache and found there since the
    engine started (the counts of vLLM's vllm:prefix_cache_queries and _hits)."""

    __slots__ = ("_floats", "_ints", "_lock")

    def __init__(
        self,
        running: int = 0,
        waiting: int = 0,
        kv_cache_usage: float = 0.0,
        reported_unix_nanos: int = 0,
        prefix_cache_queries: int = 0,
        prefix_cache_hits: int = 0,
        *,
        memory: tuple[MutableSequence[int], MutableSequence[float], Any] | None = None,
    ) -> None:
        # memory: shared integers, floats and the lock that orders writers (shared()).
        if memory is None:
            self._ints: MutableSequence[int] = [0] * len(_INTS)
            self._floats: MutableSequence[float] = [0.0]
            self._lock: Any = contextlib.nullcontext()
        else:
            self._ints, self._floats, self._lock = memory
        values = (running, waiting, reported_unix_nanos, prefix_cache_queries, prefix_cache_hits)
        if any(values) or kv_cache_usage:
            self._ints[:] = list(values)
            self._floats[0] = kv_cache_usage

    @classmethod
    def shared(cls, context: SpawnContext) -> EngineLoad:
        """One load in shared memory, handed to each front end as it is spawned."""
        return cls(
            memory=(context.RawArray("q", len(_INTS)), context.RawArray("d", 1), context.Lock())
        )

    running = property(lambda self: self._ints[0])
    waiting = property(lambda self: self._ints[1])
    reported_unix_nanos = property(lambda self: self._ints[2])
    prefix_cache_queries = property(lambda self: self._ints[3])
    prefix_cache_hits = property(lambda self: self._ints[4])
    kv_cache_usage = property(lambda self: self._floats[0])

    def report(
        self, running: int, waiting: int, kv_cache_usage: float, queries: int, hits: int
    ) -> None:
        """One step's report: the figures now, and the step's prefix-cache lookups added.
        Queries first: a reader taking hits, then queries, never sees more hits than queries."""
        with self._lock:
            ints = self._ints
            ints[0], ints[1] = running, waiting
            self._floats[0] = kv_cache_usage
            ints[3] += queries
            ints[4] += hits
            ints[2] = time.time_ns()

    def __reduce__(self) -> Any:
        if isinstance(self._lock, contextlib.nullcontext):
            return (EngineLoad, tuple(getattr(self, name) for name in _ORDER))
        # Shared memory travels only to a process being spawned (multiprocessing checks).
        return (_shared_load, (self._ints, self._floats, self._lock))


# The constructor's positional order.
_ORDER = (
    "running",
    "waiting",
    "kv_cache_usage",
    "reported_unix_nanos",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


def _shared_load(ints: Any, floats: Any, lock: Any) -> EngineLoad:
    return EngineLoad(memory=(ints, floats, lock))


def shared_step_clock(context: SpawnContext) -> MutableSequence[float]:
    """The time (time.monotonic, one clock for every process of the machine) of the engine's
    last step, in shared memory for every front end's EngineActivity."""
    clock: MutableSequence[float] = context.RawArray("d", 1)
    clock[0] = time.monotonic()
    return clock


@dataclass(frozen=True)
class EngineShare:
    """What a front end of a shared engine is handed as it is spawned (worker/frontends.py):
    its place among the front ends, vLLM's client addresses of the engine (the ZMQ listeners
    the supervisor bound for it), and the memory the front ends share."""

    index: int
    count: int
    client: dict[str, Any]
    load: EngineLoad
    steps: MutableSequence[float]
    # Each front end's own metrics port, which it writes once it listens (0 before).
    metrics_ports: MutableSequence[int]
    # The streams the front ends have admitted together (a multiprocessing Value, admission.py).
    admitted: Any
