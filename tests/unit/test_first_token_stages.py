"""The first token's stages: the edge's access-log lines parsed and joined with the client's
and the worker's times, and quantiles of histogram buckets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.first_token_stages import (
    STAGES,
    EdgeLog,
    bucket_quantile,
    edge_times,
    joined,
    markdown,
    parse_buckets,
    summary,
)
from tokenmesh.meshconfig.access_logs import ACCESS_LOG_FIELDS, EDGE_FIELDS

# Lines as the edge Envoy of a local mesh writes them (direct token path): a stream the
# gateway prepared and a worker answered, a worker listener's line of the same id (another
# hop: not the edge's), an Envoy log line, and a stream refused before any upstream.
EDGE_LINE = {
    "listener": "edge", "path": "/tokenmesh.v1.LLMService/Generate", "protocol": "HTTP/2",
    "response_code": 200, "grpc_status": "OK", "flags": "-", "details": "via_upstream",
    "upstream_cluster": "worker", "upstream_host": "127.0.0.1:40123", "duration_ms": 412,
    "upstream_sent_ms": 3, "upstream_request_end_ms": 3, "attempts": 1, "first_byte_ms": 31,
    "first_sent_ms": 31, "bytes_sent": 4410, "request_id": "7f0c2a", "time":
    "2026-12-07T05:52:01.123Z", "start_unix_us": "1796622721123456", "upstream_sent_us": 3210,
    "first_byte_us": 31044, "first_sent_us": 31102, "worker": "127.0.0.1:40123",
    "prepare_headers_us": 611, "prepare_body_us": 1874,
}  # fmt: skip
SENT_NS = 1796622721123456000 - 140_000  # the client sent 0.14 ms before Envoy's arrival
EMITTED_NS = 1796622721123456000 + 29_500_000  # the worker built the first message at 29.5 ms
FIRST_NS = 1796622721123456000 + 31_800_000  # the client read it at 31.8 ms


def lines() -> list[bytes]:
    worker_hop = {**EDGE_LINE, "listener": "worker", "start_unix_us": "1796622721125000"}
    refused = {
        **EDGE_LINE, "request_id": "9d11", "response_code": 503, "upstream_sent_us": None,
        "first_byte_us": None, "first_sent_us": 250, "prepare_body_us": None,
    }  # fmt: skip
    return [
        json.dumps(EDGE_LINE).encode(),
        json.dumps(worker_hop).encode(),
        b"[2026-12-07 05:52:01.200][41][warning][main] something Envoy said",
        json.dumps(refused).encode(),
    ]


def test_the_parser_reads_fields_the_access_log_writes() -> None:
    written = set(ACCESS_LOG_FIELDS) | set(EDGE_FIELDS) | {"listener"}
    read = {"start_unix_us", "upstream_sent_us", "first_byte_us", "first_sent_us",
            "prepare_headers_us", "prepare_body_us", "request_id"}  # fmt: skip
    assert read <= written, read - written
    for key in ("upstream_sent_us", "first_byte_us", "first_sent_us"):
        assert ACCESS_LOG_FIELDS[key].endswith(":us)%"), key
    assert ACCESS_LOG_FIELDS["start_unix_us"] == "%START_TIME(%s%6f)%"


def test_only_the_edges_lines_of_answered_streams_are_kept() -> None:
    found = edge_times(lines())
    assert set(found) == {"7f0c2a"}
    times = found["7f0c2a"]
    assert times.start_us == 1796622721123456
    assert times.prepare_us == 611 + 1874
    assert (times.upstream_sent_us, times.first_byte_us, times.first_sent_us) == (
        3210,
        31044,
        31102,
    )
    assert edge_times(lines(), {"someone-else"}) == {}


def test_without_the_external_processor_there_is_no_preparation() -> None:
    line = {**EDGE_LINE, "prepare_headers_us": "-", "prepare_body_us": "-"}
    assert edge_times([json.dumps(line)])["7f0c2a"].prepare_us is None


def test_stages_place_the_first_token_between_the_clocks_and_sum_to_the_ttft() -> None:
    [row] = joined([("7f0c2a", SENT_NS, FIRST_NS, EMITTED_NS)], edge_times(lines()))
    assert row == {
        "to_edge": 0.14,
        "prepare": 2.485,
        "to_worker": 0.725,
        "worker_first": 26.29,
        "to_envoy": 1.544,
        "to_caller": 0.058,
        "to_client": 0.698,
        "ttft": 31.94,
    }
    parts = sum(value for key, value in row.items() if key != "ttft")
    assert parts == pytest.approx(row["ttft"], abs=1e-6)


def test_requests_without_a_line_or_an_emitted_time_are_left_out() -> None:
    firsts = [
        ("7f0c2a", SENT_NS, FIRST_NS, 0),
        ("not-logged", SENT_NS, FIRST_NS, EMITTED_NS),
    ]
    assert joined(firsts, edge_times(lines())) == []


def test_summary_gives_each_stages_p50_and_p99_over_the_joined() -> None:
    rows = [{key: float(n) for key, _ in STAGES} for n in range(1, 101)]
    figures = summary(rows, requests=104)
    assert (figures["requests"], figures["joined"]) == (104, 100)
    assert figures["worker_first"] == {"p50_ms": 50.0, "p99_ms": 99.0}
    assert "ttft" not in summary([], 3)


def test_the_log_is_read_from_where_it_stood_when_opened(tmp_path: Path) -> None:
    log = tmp_path / "envoy.log"
    log.write_bytes(json.dumps(EDGE_LINE).encode() + b"\n")
    opened = EdgeLog(log)
    later = {**EDGE_LINE, "request_id": "b2"}
    with log.open("ab") as text:
        text.write(json.dumps(later).encode() + b"\n")
    assert set(opened.times({"7f0c2a", "b2"}, within=0)) == {"b2"}


METRICS = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="tiny"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.2
# HELP tokenmesh_ttft_seconds Time to first token.
# TYPE tokenmesh_ttft_seconds histogram
tokenmesh_ttft_seconds_bucket{le="0.01"} 1.0
tokenmesh_ttft_seconds_bucket{le="+Inf"} 4.0
tokenmesh_ttft_seconds_count 4.0
tokenmesh_ttft_seconds_sum 3.0
"""


def test_histogram_buckets_parse_and_give_interpolated_quantiles() -> None:
    counts = parse_buckets(METRICS, ["vllm:time_to_first_token_seconds"])
    engine = counts["vllm:time_to_first_token_seconds"]
    assert engine == {0.01: 2.0, 0.02: 6.0, 0.04: 10.0, float("inf"): 10.0}
    # The 5th of 10 is 3/4 of the way through the (10, 20] ms bucket's four.
    assert bucket_quantile(engine, 0.5) == 17.5
    assert bucket_quantile(engine, 0.99) == pytest.approx(39.5)
    # Past the last finite bound: that bound, as Prometheus says.
    ttft = parse_buckets(METRICS, ["tokenmesh_ttft_seconds"])["tokenmesh_ttft_seconds"]
    assert bucket_quantile(ttft, 0.99) == 10.0
    assert bucket_quantile({0.01: 0.0, float("inf"): 0.0}, 0.5) is None


def test_the_table_lists_stages_and_the_clients_ttft_where_nothing_joined() -> None:
    mesh = {
        "path": "edge gRPC", "streams": 32, "ttft_ms": {"p50_ms": 40.0, "p99_ms": 90.0},
        "first_token_stages": {
            **summary([{key: 2.0 for key, _ in STAGES}], 1),
            "histograms": {"engine_ttft": {"p50_ms": 17.5, "p99_ms": 39.5, "count": 10}},
        },
    }  # fmt: skip
    sse = {
        "path": "vLLM OpenAI SSE", "streams": 32, "ttft_ms": {"p50_ms": 35.0, "p99_ms": 80.0},
        "first_token_stages": {"histograms": {"engine_ttft": {"p50_ms": 15.0, "p99_ms": 30.0}}},
    }  # fmt: skip
    other = {"path": "edge gRPC, gateway path", "streams": 32, "first_token_stages": None}
    table = markdown([mesh, sse, other]).splitlines()
    assert len(table) == 4, table
    assert table[2].startswith("| edge gRPC | 32 | 1 of 1 | 2.0 / 2.0 |")
    assert table[2].endswith("| 17.5 / 39.5 |")
    # vLLM's server: no stages, its client's TTFT and vLLM's own.
    assert table[3].endswith("| 35.0 / 80.0 |  |  | 15.0 / 30.0 |")
