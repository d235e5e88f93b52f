"""Field checks shared by every service's request validation; failures name field and limit."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenmesh.common.errors import InvalidArgument


def check_range(field: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    """value must be finite and in [low, high] (or (low, high] when low_open)."""
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        bracket = "(" if low_open else "["
        raise InvalidArgument(field, f"must be in {bracket}{low:g}, {high:g}], got {value}")


def check_text(field: str, value: str, max_bytes: int, required: bool = True) -> None:
    """value must be non-empty (when required) and at most max_bytes of UTF-8."""
    if required and not value:
        raise InvalidArgument(field, "must not be empty")
    size = len(value.encode())
    if size > max_bytes:
        raise InvalidArgument(field, f"is {size} bytes, over the limit of {max_bytes}")


def check_count(field: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise InvalidArgument(field, f"has {count} {what}, over the limit of {limit}")


def check_stop(field: str, stops: Sequence[str], max_count: int, max_bytes: int) -> None:
    """At most max_count stop strings, each 1..max_bytes of UTF-8."""
    check_count(field, len(stops), max_count, "sequences")
    for position, stop in enumerate(stops):
        size = len(stop.encode())
        if not stop or size > max_bytes:
            raise InvalidArgument(
                f"{field}[{position}]", f"must be 1..{max_bytes} bytes, got {size}"
            )


def check_logprobs(prefix: str, logprobs: bool, top_logprobs: int, cap: int) -> None:
    """top_logprobs must be in [0, cap] and needs logprobs; prefix names the message."""
    if top_logprobs == 0:
        return
    if not 0 <= top_logprobs <= cap:
        raise InvalidArgument(f"{prefix}top_logprobs", f"must be in [0, {cap}], got {top_logprobs}")
    if not logprobs:
        raise InvalidArgument(f"{prefix}top_logprobs", f"needs {prefix}logprobs set to true")
