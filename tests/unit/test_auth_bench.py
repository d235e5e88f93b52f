"""The auth benchmark's tooling works: both servers stream, and its figures are sane."""

from __future__ import annotations

from loadtests.auth_bench import MESSAGES, run


async def test_auth_bench_streams_through_both_stacks_and_reports_sane_figures() -> None:
    result = await run(requests=6, warmup=1)
    assert result["messages_per_stream"] == MESSAGES
    for name in ("ttft_plain", "ttft_keyed", "stream_plain", "stream_keyed"):
        figures = result[name]
        assert figures["count"] == 6
        assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    assert result["ttft_keyed"]["p50_ms"] <= result["stream_keyed"]["p50_ms"]
    assert result["quota_charge_us_per_token"] > 0
