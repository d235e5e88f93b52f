"""A circuit breaker for calls to a dependency (the reranker).

Hand-written on purpose: the maintained asyncio breakers (purgatory, aiobreaker) trip on
consecutive failures only; this one also trips on a failure rate over a rolling window, limits
concurrent half-open probes, and lets the caller decide what counts as a failure.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable

from tokenmesh.gateway.config import BreakerSettings


class CircuitState(enum.IntEnum):
    """Values are what the tokenmesh_reranker_circuit_state gauge reports."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitOpenError(Exception):
    """The circuit refuses the call without trying it."""

    def __init__(self, state: CircuitState) -> None:
        super().__init__(f"circuit {state.name.lower().replace('_', '-')}")
        self.state = state


TransitionListener = Callable[[CircuitState, CircuitState], None]


class CircuitBreaker:
    """CLOSED → OPEN on too many failures; OPEN refuses calls for open_seconds; then HALF_OPEN
    lets up to half_open_max_calls probes through: a success closes, a failure re-opens."""

    def __init__(
        self,
        settings: BreakerSettings,
        on_transition: TransitionListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._on_transition = on_transition
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._opened_at = 0.0
        self._consecutive_failures = 0
        # (time, failed) of recent calls, oldest first, for the failure rate.
        self._window: deque[tuple[float, bool]] = deque()
        self._probes_in_flight = 0

    @property
    def state(self) -> CircuitState:
        if (
            self._state is CircuitState.OPEN
            and self._clock() - self._opened_at >= self._settings.open_seconds
        ):
            self._transition(CircuitState.HALF_OPEN)
        return self._state

    def acquire(self) -> None:
        """Ask to make a call; raises CircuitOpenError when the circuit refuses it. Every
        acquire must be followed by exactly one of record_success/record_failure/release."""
        state = self.state
        if state is CircuitState.OPEN:
            raise CircuitOpenError(state)
        if state is CircuitState.HALF_OPEN:
            if self._probes_in_flight >= self._settings.half_open_max_calls:
                raise CircuitOpenError(state)
            self._probes_in_flight += 1

    def release(self) -> None:
        """The call ended without a verdict (e.g. the caller cancelled it)."""
        if self._state is CircuitState.HALF_OPEN and self._probes_in_flight:
            self._probes_in_flight -= 1

    def record_success(self) -> None:
        self.release()
        self._consecutive_failures = 0
        if self._state is CircuitState.HALF_OPEN:
            self._transition(CircuitState.CLOSED)
            return
        self._remember(failed=False)

    def record_failure(self) -> None:
        self.release()
        if self._state is CircuitState.HALF_OPEN:
            self._open()
            return
        if self._state is CircuitState.OPEN:
            return
        self._consecutive_failures += 1
        self._remember(failed=True)
        if (
            self._consecutive_failures >= self._settings.consecutive_failures
            or self._rate_tripped()
        ):
            self._open()

    def _remember(self, failed: bool) -> None:
        now = self._clock()
        self._window.append((now, failed))
        horizon = now - self._settings.window_seconds
        while self._window and self._window[0][0] < horizon:
            self._window.popleft()

    def _rate_tripped(self) -> bool:
        calls = len(self._window)
        if calls < self._settings.min_calls_in_window:
            return False
        failures = sum(1 for _, failed in self._window if failed)
        return failures / calls >= self._settings.failure_rate

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._transition(CircuitState.OPEN)

    def _transition(self, new: CircuitState) -> None:
        old, self._state = self._state, new
        self._probes_in_flight = 0
        if new is CircuitState.CLOSED:
            self._consecutive_failures = 0
            self._window.clear()
        if old is not new and self._on_transition is not None:
            self._on_transition(old, new)
