"""The load generator through the whole mesh's edge, briefly (seconds): gRPC, REST/JSON via
Envoy's transcoder with bytes counted on the wire, and an open loop with reranked documents.
It proves the benchmark scenarios' tooling works and its numbers are sane; the figures live in
`make bench` reports, never in assertions here."""

from __future__ import annotations

from typing import Any

import pytest

from loadtests.runner import RunConfig, run
from tokenmesh.localmesh.mesh import LocalMesh

pytestmark = pytest.mark.integration

BRIEF = {"duration": 1.5, "warmup": 0.5, "requests": 60, "output_tokens": "8"}


def edge(mesh: LocalMesh) -> str:
    return f"127.0.0.1:{mesh.settings.edge_port}"


def assert_sane(result: dict[str, Any], tokens_per_request: int) -> None:
    assert result["requests"] > 0
    assert result["errors"] == 0, result["status"]
    assert result["tokens"] == tokens_per_request * result["requests"]
    for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
        ordered = [result[metric][k] for k in ("p50_ms", "p90_ms", "p99_ms", "p99.9_ms")]
        assert ordered == sorted(ordered), (metric, ordered)
    # Tokens that arrive together have gaps of 0 ms at this resolution; a request never does.
    assert result["ttft_ms"]["p50_ms"] > 0 and result["e2e_ms"]["p50_ms"] > 0
    # The worker's emission time of every token came through (gateway, Envoy, transcoder).
    assert result["server_itl_ms"]["count"] == result["itl_ms"]["count"]
    # A stream ends after its first token.
    assert result["e2e_ms"]["p50_ms"] >= result["ttft_ms"]["p50_ms"]


@pytest.mark.parametrize("kind", ["llm", "rest"])
def test_edge_streams_over_grpc_and_rest_with_bytes_counted(mesh: LocalMesh, kind: str) -> None:
    config = RunConfig(
        target=kind, address=edge(mesh), concurrency=4, count_bytes=True, label=kind, **BRIEF
    )
    result = run(config, show_progress=False)
    assert_sane(result, 8)
    wire = result["wire_bytes"]
    assert wire["tokens"] >= result["tokens"]
    # Each token message carries at least its text, index and timestamp.
    assert wire["received_per_token"] > 10


def test_open_loop_with_reranked_documents_through_the_edge(mesh: LocalMesh) -> None:
    config = RunConfig(
        target="llm", address=edge(mesh), mode="open", rate=8.0, documents=4, **BRIEF
    )
    result = run(config, show_progress=False)
    assert_sane(result, 8)
    assert result["generator"]["send_lag_ms"]["count"] == result["requests"]
    assert len(result["timeline"]) == result["requests"]
