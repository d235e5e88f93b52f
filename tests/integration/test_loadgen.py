"""The load generator against a real vLLM worker, briefly: it proves the tooling works end to
end (spawned uvloop processes, HDR percentiles, result file); the figures themselves belong in
benchmark reports (`make bench`), not in assertions."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests import report
from loadtests.runner import RunConfig, run
from tests.support import ServiceProcess

pytestmark = pytest.mark.integration


def test_closed_loop_against_a_real_worker_completes_without_errors(
    worker: ServiceProcess, tmp_path: Path
) -> None:
    config = RunConfig(
        target="worker",
        address=worker.address,
        concurrency=4,
        processes=2,
        duration=2.0,
        warmup=0.5,
        requests=40,
        output_tokens="8",
        label="smoke",
    )
    result = run(config, show_progress=False)
    assert result["requests"] > 0
    assert result["errors"] == 0, result["status"]
    assert result["tokens"] == 8 * result["requests"]
    for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
        ordered = [result[metric][k] for k in ("p50_ms", "p90_ms", "p99_ms", "p99.9_ms", "max_ms")]
        assert ordered == sorted(ordered), (metric, ordered)
    # Tokens that arrive together have gaps of 0 ms at this resolution; a request never does.
    assert result["ttft_ms"]["p50_ms"] > 0 and result["e2e_ms"]["p50_ms"] > 0
    # The worker's emission time of every token came through (gateway, Envoy, transcoder).
    assert result["server_itl_ms"]["count"] == result["itl_ms"]["count"]
    # Every token after the first of a stream is one gap.
    assert result["itl_ms"]["count"] == 7 * result["requests"]
    assert len(result["generator"]["cpu_fraction_per_process"]) == 2
    assert len(result["load_average_start"]) == 3
    report.write_json(result, tmp_path / "smoke.json")
    report.plot_cdfs([result], "itl", tmp_path / "itl.png", "ITL")
    assert (tmp_path / "itl.png").stat().st_size > 0


def test_grpc_floor_forwards_every_message_through_both_proxy_shapes() -> None:
    """grpc_floor's processes (a source, a proxy with either shape, a client) move every
    message, and each figure is the process's own CPU per message."""
    from loadtests import grpc_floor

    rounds = [grpc_floor.measure(shape, 4, 25, 0.0) for shape in grpc_floor.SHAPES]
    assert [r["messages"] for r in rounds] == [100, 100]
    assert rounds[0]["messages_out"] == 100 and 1 <= rounds[1]["messages_out"] <= 100
    assert all(r["proxy_us_per_message"] >= 0 and r["server_us_per_message"] >= 0 for r in rounds)
    paced = grpc_floor.measure("direct", 2, 10, 0.01)
    assert paced["messages"] == 20
    # 10 messages 10 ms apart: the stream cannot go faster than its pace.
    assert paced["messages_per_second"] <= 2 * 100
    summary = grpc_floor.summary([*rounds, rounds[0]])
    assert summary["direct"]["server_us_per_message"] == rounds[0]["server_us_per_message"]
