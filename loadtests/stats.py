"""Latency percentiles for benchmarks, recorded in HDR histograms (microsecond resolution)."""

from __future__ import annotations

from hdrh.histogram import HdrHistogram

# 1 µs .. 10 min, 3 significant digits.
LOWEST_US, HIGHEST_US, DIGITS = 1, 600_000_000, 3


class Latencies:
    def __init__(self) -> None:
        self._histogram = HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)

    def record(self, seconds: float) -> None:
        self._histogram.record_value(max(int(seconds * 1e6), LOWEST_US))

    @property
    def count(self) -> int:
        return int(self._histogram.get_total_count())

    def ms(self, percentile: float) -> float:
        return round(self._histogram.get_value_at_percentile(percentile) / 1e3, 2)

    def summary(self) -> dict[str, float]:
        return {
            "count": self.count,
            "p50_ms": self.ms(50),
            "p90_ms": self.ms(90),
            "p99_ms": self.ms(99),
            "max_ms": self.ms(100),
        }
