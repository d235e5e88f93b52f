"""Latency percentiles for benchmarks, recorded in HDR histograms (microsecond resolution)."""

from __future__ import annotations

from hdrh.histogram import HdrHistogram

# 1 µs .. 10 min, 3 significant digits.
LOWEST_US, HIGHEST_US, DIGITS = 1, 600_000_000, 3
# The percentiles every load-test report gives.
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


class Latencies:
    def __init__(self, histogram: HdrHistogram | None = None) -> None:
        self._histogram = histogram or HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)

    def record(self, seconds: float) -> None:
        value = min(max(int(seconds * 1e6), LOWEST_US), HIGHEST_US)
        self._histogram.record_value(value)

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

    def percentiles(self) -> dict[str, float]:
        """count, p50/p90/p99/p99.9, max and mean in ms (0 when nothing was recorded)."""
        if not self.count:
            return {"count": 0, **{label(p): 0.0 for p in PERCENTILES}, "max_ms": 0.0}
        return {
            "count": self.count,
            **{label(p): self.ms(p) for p in PERCENTILES},
            "max_ms": self.ms(100),
            "mean_ms": round(self._histogram.get_mean_value() / 1e3, 2),
        }

    def merge(self, other: Latencies) -> None:
        self._histogram.add(other._histogram)

    def encode(self) -> str:
        """The histogram in HdrHistogram's compressed base64 form (kept in result files)."""
        return str(self._histogram.encode().decode("ascii"))

    @classmethod
    def decode(cls, encoded: str) -> Latencies:
        return cls(HdrHistogram.decode(encoded.encode("ascii")))

    def cdf(self) -> list[tuple[float, float]]:
        """(latency ms, fraction of samples at or below it) at every recorded value."""
        points = []
        for item in self._histogram.get_recorded_iterator():
            points.append((item.value_iterated_to / 1e3, item.percentile / 100))
        return points


def label(percentile: float) -> str:
    """50.0 -> 'p50_ms', 99.9 -> 'p99.9_ms'."""
    return f"p{percentile:g}_ms"
