"""How long a stream's later tokens gather into one message while the worker's server loop is
behind (decision 0039).

Every message costs the worker's gRPC loop, Envoy and the caller about the same whatever it
holds. While the loop keeps up, each engine output goes out the moment it exists. When it falls
behind, its writes of streams' tokens delay every new call's intake and first token; then each
stream sends at most one message per `hold` seconds (its first at once, and its last the moment
the stream ends), so that fewer, larger messages leave the loop time for new calls.
"""

from __future__ import annotations


class StreamPacing:
    """Sets `hold` from the loop's lag: how late the server's loop runs the delivery of an
    engine step's outputs (engine_thread.Handoff), from the first output posted.

    Over each `period`, the mean lag decides: above `lag_target` the hold doubles (from
    `lag_target`), up to `hold_max`; under half the target it shrinks by a fifth, to 0 once it
    is under half the target; between, it stays. A period without deliveries (no outputs for
    the loop to send) ends the hold. hold_max 0: never held.
    """

    __slots__ = ("_count", "_hold_max", "_period", "_since", "_sum", "_target", "hold", "lag")

    def __init__(self, lag_target: float, hold_max: float, period: float = 0.05) -> None:
        if lag_target <= 0 or hold_max < 0 or period <= 0:
            raise ValueError("lag_target and period must be > 0 and hold_max >= 0")
        self._target = lag_target
        self._hold_max = hold_max
        self._period = period
        # Seconds a stream waits after a message before its next (0: it sends at once).
        self.hold = 0.0
        # The mean lag of the last period, in seconds.
        self.lag = 0.0
        self._since: float | None = None
        self._sum = 0.0
        self._count = 0

    def quiet(self, now: float) -> bool:
        """No delivery for more than two periods by monotonic time `now`: nothing holds, and
        no lag is being measured (the gauges read 0, not the last busy period's figures)."""
        return self._since is None or now - self._since > 2 * self._period

    def hold_at(self, now: float) -> float:
        return 0.0 if self.quiet(now) else self.hold

    def lag_at(self, now: float) -> float:
        return 0.0 if self.quiet(now) else self.lag

    def observe(self, lag: float, now: float) -> None:
        """One delivery, `lag` seconds late, at monotonic time `now`."""
        if self.quiet(now):
            # The first delivery, or the first after a quiet spell: the loop had nothing of
            # the engine's to send meanwhile.
            self.hold = self.lag = 0.0
            self._since, self._sum, self._count = now, lag, 1
            return
        assert self._since is not None  # not quiet: a period has begun
        self._sum += lag
        self._count += 1
        if now - self._since < self._period:
            return
        self.lag = self._sum / self._count
        self._since, self._sum, self._count = now, 0.0, 0
        if self._hold_max == 0:
            return
        if self.lag > self._target:
            self.hold = min(self._hold_max, max(2 * self.hold, self._target))
        elif self.lag < self._target / 2:
            shorter = 0.8 * self.hold
            self.hold = shorter if shorter >= self._target / 2 else 0.0
