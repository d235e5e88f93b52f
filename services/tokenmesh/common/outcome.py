"""How an RPC or call ended, decided once: a deadline, a cancel, or its status code."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from grpc import aio

# A caller whose deadline passes resets the stream itself, usually a moment before the
# server's own deadline timer fires (and Envoy resets a call it proxies when the deadline
# passes); an end this close to the deadline is the deadline passing.
DEADLINE_SLACK_SECONDS = 0.1

CANCELLED = "CANCELLED"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
INTERRUPTED = frozenset({CANCELLED, DEADLINE_EXCEEDED})


class Deadline:
    """A deadline on the monotonic clock, read when the RPC or call starts (the context's view
    of it is not reliable once the RPC has been cancelled)."""

    __slots__ = ("_at",)

    def __init__(self, remaining: float | None) -> None:
        self._at = None if remaining is None else time.monotonic() + remaining

    @classmethod
    def of(cls, context: aio.ServicerContext[Any, Any]) -> Deadline:
        return cls(context.time_remaining())

    @classmethod
    def after(cls, timeout: float | None, elapsed: float) -> Deadline:
        """A deadline `timeout` seconds from an RPC's start, `elapsed` seconds after it (an
        RPC known from a log, after its end)."""
        return cls(None if timeout is None else timeout - elapsed)

    def remaining(self) -> float | None:
        """Seconds left (None: no deadline); never below 0."""
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    def passed(self) -> bool:
        """Whether the deadline has (all but) passed."""
        return self._at is not None and time.monotonic() >= self._at - DEADLINE_SLACK_SECONDS

    def interruption(self) -> str:
        """What an interrupted RPC ended with: DEADLINE_EXCEEDED or CANCELLED."""
        return DEADLINE_EXCEEDED if self.passed() else CANCELLED


def ended(code: str | None, deadline: Deadline, interrupted: bool, failure: str) -> str:
    """How an RPC ended, from what is known of it, in this order: the caller interrupted it
    (DEADLINE_EXCEEDED once its deadline had all but passed, else CANCELLED); its status code;
    else `failure` (what an end with neither means where it was seen)."""
    if interrupted:
        return deadline.interruption()
    return code if code is not None else failure


def final_code(
    context: aio.ServicerContext[Any, Any],
    deadline: Deadline,
    error: BaseException | None = None,
    *,
    cut_short: bool = False,
) -> str:
    """The status code an RPC ended with, as a grpc_code label value. `error` is what the
    handler raised (a cancel is CancelledError or GeneratorExit); `cut_short`: the RPC ended
    without error but before its end (a token stream without its last token), which only a
    cancel or the deadline does."""
    cancelled = isinstance(error, (asyncio.CancelledError, GeneratorExit))
    status = context.code()
    code = str(status.name) if isinstance(status, grpc.StatusCode) else None
    failed = error is not None and not isinstance(error, aio.AbortError)
    interrupted = cancelled or (code is None and cut_short)
    return ended(code, deadline, interrupted, "UNKNOWN" if failed else "OK")
