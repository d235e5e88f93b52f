"""The reranker circuit breaker's state machine, driven by a manual clock."""

from __future__ import annotations

import pytest

from tokenmesh.gateway.config import BreakerSettings
from tokenmesh.gateway.core.breaker import CircuitBreaker, CircuitOpenError, CircuitState


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def breaker(**settings: float) -> tuple[CircuitBreaker, Clock, list[tuple[str, str]]]:
    clock = Clock()
    transitions: list[tuple[str, str]] = []
    circuit = CircuitBreaker(
        BreakerSettings(**settings),
        on_transition=lambda old, new: transitions.append((old.name, new.name)),
        clock=clock,
    )
    return circuit, clock, transitions


def fail(circuit: CircuitBreaker, times: int = 1) -> None:
    for _ in range(times):
        circuit.acquire()
        circuit.record_failure()


def succeed(circuit: CircuitBreaker, times: int = 1) -> None:
    for _ in range(times):
        circuit.acquire()
        circuit.record_success()


def test_opens_after_consecutive_failures_and_refuses_without_calling() -> None:
    circuit, _, transitions = breaker(consecutive_failures=3)
    fail(circuit, 2)
    assert circuit.state is CircuitState.CLOSED
    fail(circuit)
    assert circuit.state is CircuitState.OPEN
    with pytest.raises(CircuitOpenError, match="circuit open"):
        circuit.acquire()
    assert transitions == [("CLOSED", "OPEN")]


def test_a_success_resets_the_consecutive_count() -> None:
    circuit, _, _ = breaker(consecutive_failures=3, min_calls_in_window=100)
    fail(circuit, 2)
    succeed(circuit)
    fail(circuit, 2)
    assert circuit.state is CircuitState.CLOSED


def test_opens_on_failure_rate_over_the_window() -> None:
    circuit, _, _ = breaker(
        consecutive_failures=100, failure_rate=0.5, min_calls_in_window=10, window_seconds=10
    )
    for _ in range(4):
        succeed(circuit)
        fail(circuit)
    assert circuit.state is CircuitState.CLOSED  # 8 calls: under the minimum
    succeed(circuit)
    fail(circuit)  # 10 calls, 5 failed: 50 %
    assert circuit.state is CircuitState.OPEN


def test_old_calls_leave_the_window() -> None:
    circuit, clock, _ = breaker(
        consecutive_failures=100, failure_rate=0.5, min_calls_in_window=4, window_seconds=10
    )
    fail(circuit)
    succeed(circuit)
    fail(circuit)
    clock.now = 20  # the three above are out of the window now
    succeed(circuit, 3)
    fail(circuit)
    assert circuit.state is CircuitState.CLOSED


def test_half_open_after_cooldown_lets_limited_probes_and_success_closes() -> None:
    circuit, clock, transitions = breaker(consecutive_failures=1, open_seconds=5)
    fail(circuit)
    clock.now = 4.9
    assert circuit.state is CircuitState.OPEN
    clock.now = 5.0
    assert circuit.state is CircuitState.HALF_OPEN
    circuit.acquire()  # the one probe
    with pytest.raises(CircuitOpenError, match="half-open"):
        circuit.acquire()
    circuit.record_success()
    assert circuit.state is CircuitState.CLOSED
    assert transitions == [("CLOSED", "OPEN"), ("OPEN", "HALF_OPEN"), ("HALF_OPEN", "CLOSED")]


def test_failed_probe_reopens_for_a_new_cooldown() -> None:
    circuit, clock, _ = breaker(consecutive_failures=1, open_seconds=5)
    fail(circuit)
    clock.now = 5
    fail(circuit)
    assert circuit.state is CircuitState.OPEN
    clock.now = 9
    assert circuit.state is CircuitState.OPEN
    clock.now = 10
    assert circuit.state is CircuitState.HALF_OPEN


def test_released_probe_frees_its_slot_without_a_verdict() -> None:
    circuit, clock, _ = breaker(consecutive_failures=1, open_seconds=1)
    fail(circuit)
    clock.now = 1
    circuit.acquire()
    circuit.release()
    assert circuit.state is CircuitState.HALF_OPEN
    circuit.acquire()
