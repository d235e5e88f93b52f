"""Exponential backoff with jitter for retry loops against flaky dependencies (e.g. Consul)."""

from __future__ import annotations

import random


class Backoff:
    """Delays for consecutive failures: initial, 2x, 4x, ... capped at maximum, each jittered.

    "Equal jitter": a delay d becomes uniform(d/2, d), so many clients that failed together
    (say, every service when Consul restarts) spread their retries out, yet none retries in a
    hot loop (the delay never drops below half its step). reset() after a success.
    PyPI tenacity/backoff would do this too; neither is a dependency, and this is all we need.
    """

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        if not 0 < initial <= maximum:
            raise ValueError(f"need 0 < initial <= maximum, got {initial} and {maximum}")
        self.initial = initial
        self.maximum = maximum
        self._rng = rng or random.Random()
        self._failures = 0

    @property
    def failures(self) -> int:
        """Consecutive failures since the last reset()."""
        return self._failures

    def step(self, failures: int) -> float:
        """The un-jittered delay after this many consecutive failures (1 = the first)."""
        # min() before the power would overflow floats after ~1000 failures.
        return min(self.maximum, self.initial * 2.0 ** min(failures - 1, 64))

    def next_delay(self) -> float:
        """Record one more failure; the seconds to wait before the next attempt."""
        self._failures += 1
        step = self.step(self._failures)
        return self._rng.uniform(step / 2, step)

    def reset(self) -> None:
        self._failures = 0
