"""How much work a worker takes on: past a bound, new streams are refused at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tokenmesh.common.errors import ResourceExhausted


class Admission:
    """Admits a stream while the worker holds fewer than `max_running` (vLLM's batch,
    max_num_seqs) plus `max_waiting` streams and vLLM's own waiting queue is shorter than
    `max_waiting`; refuses it otherwise with RESOURCE_EXHAUSTED naming the limit. An overloaded
    worker answers at once instead of letting callers queue until their deadlines pass; the
    requests it did admit keep their latency. Both counts matter: streams arrive faster than
    vLLM's scheduler reports (once per engine step), and vLLM may keep requests waiting when
    its KV cache is full even below max_num_seqs.

    admitted: the count of streams admitted, with its lock: this process's own, or, with
    several front ends over one engine, a multiprocessing Value they share (frontends.py), so
    the bound is the worker's whatever front end a stream reaches."""

    def __init__(self, max_waiting: int, admitted: Any = None) -> None:
        self.max_waiting = max_waiting
        self._count = admitted if admitted is not None else _Count()

    @property
    def admitted(self) -> int:
        return int(self._count.value)

    @contextmanager
    def admit(self, engine_waiting: int, max_running: int) -> Iterator[None]:
        """max_running: the engine's max_num_seqs (vLLM's default for the hardware when the
        settings name none)."""
        limit = max_running + self.max_waiting
        count = self._count
        with count.get_lock():
            admitted = count.value
            if admitted < limit and engine_waiting <= self.max_waiting:
                count.value = admitted + 1
        if admitted >= limit or engine_waiting > self.max_waiting:
            raise ResourceExhausted(
                f"worker overloaded: {admitted} streams admitted, {engine_waiting} waiting "
                f"in the engine; limits max_num_seqs={max_running} + "
                f"max_waiting_requests={self.max_waiting}; retry later or elsewhere"
            )
        try:
            yield
        finally:
            with count.get_lock():
                count.value -= 1


class _Count:
    """One process's count, shaped as a multiprocessing Value (value, get_lock())."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self.value = 0
        # Uncontended: every stream's admission runs on the server's one event loop.
        self._lock = threading.Lock()

    def get_lock(self) -> threading.Lock:
        return self._lock
