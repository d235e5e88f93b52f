"""The stall watchdog: a worker whose engine holds requests but does not move turns NOT_SERVING."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableSequence

log = logging.getLogger(__name__)


class EngineActivity:
    """What the engine holds and when it last moved: this front end's requests (each from
    submission to its end) and the time of the engine's last step, or of work reaching it
    while idle.

    Written on the engine's loop only (a count per request, a clock read per engine step);
    read from the server's loop, where a momentarily stale value is harmless. steps: the cell
    that holds the last step's time; with several front ends over one engine, shared memory
    that all of them write (engine_state.shared_step_clock), since vLLM reports each step to
    one front end only.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        steps: MutableSequence[float] | None = None,
    ) -> None:
        self._clock = clock
        self.requests = 0
        self._busy_since = clock()
        self._steps = steps if steps is not None else [clock()]

    def request_started(self) -> None:
        if not self.requests:
            # An idle engine's wait for its next step starts now, not at its last step.
            self._busy_since = self._clock()
        self.requests += 1

    def request_ended(self) -> None:
        self.requests -= 1

    def stepped(self) -> None:
        self._steps[0] = self._clock()

    @property
    def moved_at(self) -> float:
        return max(self._busy_since, self._steps[0])

    def stalled_seconds(self) -> float:
        """Seconds the engine has held requests without moving; 0 while it holds none."""
        if not self.requests:
            return 0.0
        return max(0.0, self._clock() - self.moved_at)


class StallWatchdog:
    """Turns the worker NOT_SERVING while its engine holds requests and has not moved for
    `limit` seconds (a stuck kernel, a deadlock: alive, but no step), so Envoy's health checks
    take it out of rotation and Kubernetes' liveness probe restarts it; SERVING again once the
    engine moves. Each change is logged once."""

    def __init__(
        self,
        activity: EngineActivity,
        limit: float,
        set_healthy: Callable[[bool], Awaitable[None]],
    ) -> None:
        self._activity = activity
        self._limit = limit
        self._set_healthy = set_healthy
        self.stalled = False

    async def check(self) -> None:
        seconds = self._activity.stalled_seconds()
        if seconds >= self._limit and not self.stalled:
            self.stalled = True
            log.error(
                "inference engine stalled: requests in flight and no engine step for %.0f s; "
                "NOT_SERVING until it moves",
                seconds,
                extra={"requests": self._activity.requests, "engine_stall_seconds": self._limit},
            )
            await self._set_healthy(False)
        elif seconds < self._limit and self.stalled:
            self.stalled = False
            log.warning("inference engine moving again after a stall; SERVING")
            await self._set_healthy(True)
