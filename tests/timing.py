"""Latency checks: the median of several rounds against a bound, never the best round."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tests.stalls import describe, machine_stalls

# A cancel or deadline frees the engine within this (s since the cancel or the deadline).
CANCEL_BUDGET_SECONDS = 0.100
# Rounds a latency check's median is taken over (odd: the median is one of them).
ROUNDS = 3

T = TypeVar("T")


class Unmeasured(Exception):
    """A round that measured nothing: what it was to time never happened (the streams ended
    before the cancel could reach them, or never reached an engine). Neither fast nor slow, it
    is not counted, and is tried again a bounded number of times."""


@dataclass
class Rounds:
    """One latency check's rounds: what each measured (inf: it timed out), those measured
    again because the machine itself stalled during them, and those that measured nothing."""

    what: str
    bound: float
    planned: int
    seconds: list[float] = field(default_factory=list)
    stalled: list[str] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)

    @property
    def within(self) -> int:
        return sum(seconds <= self.bound for seconds in self.seconds)

    @property
    def decided(self) -> bool:
        """The median of the planned rounds is on one side of the bound whatever the rounds
        still to come measure: a majority of them is within it, or over it."""
        majority = self.planned // 2 + 1
        return self.within >= majority or len(self.seconds) - self.within >= majority

    def __str__(self) -> str:
        taken = ", ".join(f"{seconds * 1000:.0f} ms" for seconds in self.seconds)
        text = (
            f"{self.what}: {self.within} of {len(self.seconds)} rounds within "
            f"{self.bound * 1000:.0f} ms (the median of {self.planned} counts): {taken}"
        )
        text += "".join(f"; measured again: {stall}" for stall in self.stalled)
        return text + "".join(f"; measured nothing: {reason}" for reason in self.unmeasured)


async def unstalled(measure: Callable[[], Awaitable[T]], again: int) -> tuple[T, list[str]]:
    """measure()'s value, measured again (at most `again` more times) while the machine itself
    stalled during it (stolen CPU time, a kernel lockup: tests/stalls.py), and what stalled
    each measurement that was not kept. Nothing else earns a measurement another go."""
    stalled: list[str] = []
    while True:
        with machine_stalls() as stalls:
            value = await measure()
        if not stalls or len(stalled) >= again:
            return value, stalled
        stalled.append(f"{value}, {describe(stalls)}")


async def within_budget(
    what: str,
    measure: Callable[[], Awaitable[float]],
    budget: float = CANCEL_BUDGET_SECONDS,
    rounds: int = ROUNDS,
) -> Rounds:
    """Assert that the median of `rounds` rounds of measure (one round of a latency check,
    returning seconds) is within budget. The median is within it exactly when a majority of
    the rounds is, so the rounds stop once a majority has decided (two on a quiet machine).
    A mechanism that is slow in one round of two fails; one that never works (an engine left
    running, a cancel that never arrives) misses every round. A round during which the
    machine itself stalled (stolen CPU time, a kernel lockup: tests/stalls.py) is measured
    again, at most `rounds` times in all, and so is a round that measured nothing (Unmeasured:
    its streams ended before the cancel); more of those than `rounds` fail the check."""

    async def one_round() -> float | None:
        try:
            seconds = await measure()
        except Unmeasured as nothing:
            print(f"{what}: measured nothing: {nothing}")
            result.unmeasured.append(str(nothing))
            assert len(result.unmeasured) <= rounds, str(result)
            return None
        except TimeoutError as error:
            # engine_empty_at gave up waiting: an engine that never emptied, or a stall longer
            # than its window (then measured again).
            print(f"{what}: {error}")
            seconds = math.inf
        print(f"{what}: {seconds * 1000:.0f} ms")
        return seconds

    result = Rounds(what, budget, rounds)
    while not result.decided:
        seconds, stalled = await unstalled(one_round, again=rounds - len(result.stalled))
        result.stalled += stalled
        if seconds is not None:
            result.seconds.append(seconds)
    assert result.within > result.planned // 2, str(result)
    print(result)
    return result
