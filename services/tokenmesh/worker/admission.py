"""How much work a worker takes on: past a bound, new streams are refused at once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tokenmesh.common.errors import ResourceExhausted


class Admission:
    """Admits a stream while the worker holds fewer than `max_running` (vLLM's batch,
    max_num_seqs) plus `max_waiting` streams and vLLM's own waiting queue is shorter than
    `max_waiting`; refuses it otherwise with RESOURCE_EXHAUSTED naming the limit. An overloaded
    worker answers at once instead of letting callers queue until their deadlines pass; the
    requests it did admit keep their latency. Both counts matter: streams arrive faster than
    vLLM's scheduler reports (once per engine step), and vLLM may keep requests waiting when
    its KV cache is full even below max_num_seqs."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.admitted = 0

    @contextmanager
    def admit(self, engine_waiting: int, max_running: int) -> Iterator[None]:
        """max_running: the engine's max_num_seqs (vLLM's default for the hardware when the
        settings name none)."""
        limit = max_running + self.max_waiting
        if self.admitted >= limit or engine_waiting > self.max_waiting:
            raise ResourceExhausted(
                f"worker overloaded: {self.admitted} streams admitted, {engine_waiting} waiting "
                f"in the engine; limits max_num_seqs={max_running} + "
                f"max_waiting_requests={self.max_waiting}; retry later or elsewhere"
            )
        self.admitted += 1
        try:
            yield
        finally:
            self.admitted -= 1
