"""The first token's stages: the edge's access-log lines parsed and joined with the client's
and the worker's times, and quantiles of histogram buckets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.first_token_stages import (
    PARTS,
    STAGES,
    EdgeLog,
    bucket_quantile,
    edge_times,
    handler_starts,
    joined,
    markdown,
    parse_buckets,
    summary,
)
from tokenmesh.meshconfig.access_logs import ACCESS_LOG_FIELDS, EDGE_FIELDS

# One stream's lines as the edge Envoy of a local mesh wrote them (the direct token path through
# the stream relay, 32 streams): the relay listener's, then the edge's, whose external
# processor took 12.9 and 6.3 ms and whose first byte came at 266 ms.
RELAY_LINE = (
    '{"attempts":0,"bytes_sent":1815,"details":"","duration_ms":678,"first_byte_ms":null,'
    '"first_byte_us":null,"first_sent_ms":246,"first_sent_us":246227,"flags":"-",'
    '"grpc_status":"OK","listener":"worker_relay","moves":0,"parks":0,'
    '"path":"/tokenmesh.v1.InferenceService/Generate","protocol":"HTTP/2",'
    '"request_id":"444f4a6cf059467d897635421e5dd9a4","response_code":200,'
    '"start_unix_us":"1796623179879219","time":"2026-12-07T05:59:39.879Z",'
    '"upstream_cluster":"worker","upstream_host":"127.0.0.1:25576",'
    '"upstream_request_end_ms":null,"upstream_sent_ms":null,"upstream_sent_us":null}'
)
EDGE_LINE = (
    '{"attempts":1,"bytes_sent":1815,"details":"via_upstream","duration_ms":698,'
    '"first_byte_ms":266,"first_byte_us":266016,"first_sent_ms":266,"first_sent_us":266058,'
    '"flags":"-","grpc_status":"OK","listener":"edge",'
    '"path":"/tokenmesh.v1.InferenceService/Generate","prepare_body_us":"6309",'
    '"prepare_headers_us":"12948","protocol":"HTTP/2",'
    '"request_id":"444f4a6cf059467d897635421e5dd9a4","response_code":200,'
    '"start_unix_us":"1796623179859684","time":"2026-12-07T05:59:39.859Z",'
    '"upstream_cluster":"worker_relay","upstream_host":"envoy://worker_relay/",'
    '"upstream_request_end_ms":19,"upstream_sent_ms":19,"upstream_sent_us":19503,'
    '"worker":"127.0.0.1:25576"}'
)
ID = "444f4a6cf059467d897635421e5dd9a4"
START_NS = 1796623179859684000
SENT_NS = START_NS - 180_000  # the client sent 0.18 ms before Envoy's arrival
EMITTED_NS = START_NS + 262_400_000  # the worker built the first message at 262.4 ms
FIRST_NS = START_NS + 266_900_000  # the client read it at 266.9 ms


def edge_line(**changes: object) -> str:
    return json.dumps({**json.loads(EDGE_LINE), **changes})


def lines() -> list[bytes]:
    # Beside the stream's two lines: an Envoy log line, and a stream Envoy answered itself
    # (no upstream, no first byte from one).
    refused = edge_line(
        request_id="9d11", response_code=503, upstream_sent_us=None, first_byte_us=None,
        first_sent_us=250, prepare_body_us=None,
    )  # fmt: skip
    return [
        RELAY_LINE.encode(),
        b"[2026-12-07 05:59:40.200][41][warning][main] something Envoy said",
        EDGE_LINE.encode(),
        refused.encode(),
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
    assert set(found) == {ID}
    times = found[ID]
    assert times.start_us == START_NS // 1000
    assert (times.prepare_headers_us, times.prepare_body_us) == (12948, 6309)
    assert times.prepare_us == 12948 + 6309
    assert (times.upstream_sent_us, times.first_byte_us, times.first_sent_us) == (
        19503,
        266016,
        266058,
    )
    assert edge_times(lines(), {"someone-else"}) == {}


def test_without_the_external_processor_there_is_no_preparation() -> None:
    times = edge_times([edge_line(prepare_headers_us=None, prepare_body_us="-")])[ID]
    assert (times.prepare_headers_us, times.prepare_body_us, times.prepare_us) == (None, None, 0)


def test_stages_place_the_first_token_between_the_clocks_and_sum_to_the_ttft() -> None:
    [row] = joined([(ID, SENT_NS, FIRST_NS, EMITTED_NS)], edge_times(lines()))
    assert row == {
        "to_edge": 0.18,
        "prepare": 19.257,
        "to_worker": 0.246,
        "worker_first": 242.897,
        "to_envoy": 3.616,
        "to_caller": 0.042,
        "to_client": 0.842,
        "ttft": 267.08,
        "prepare_headers": 12.948,
        "prepare_body": 6.309,
    }
    parts = sum(row[key] for key, _ in STAGES if key != "ttft")
    assert parts == pytest.approx(row["ttft"], abs=1e-6)


def worker_line(method: str = "/tokenmesh.v1.InferenceService/Generate", **changes: object) -> str:
    """The worker's RPC log line (common/interceptors.py) as its JSON formatter writes it."""
    row = {
        "time": "2026-12-07 05:59:40,560", "level": "INFO",
        "logger": "tokenmesh.common.interceptors", "message": f"rpc {method} OK 670.2 ms",
        "method": method, "grpc_code": "OK", "duration_ms": 670.2, "messages_sent": 129,
        "peer": "ipv4:127.0.0.1:41234", "start_unix_us": START_NS // 1000 + 30_000,
        "request_id": ID,
    }  # fmt: skip
    return json.dumps({**row, **changes})


def test_the_workers_handler_start_splits_its_part_of_the_first_tokens_wait() -> None:
    log = [
        b"(EngineCore pid=4242) INFO 12-07 05:59:39 [core.py:1] a vLLM line",
        worker_line("/tokenmesh.v1.InferenceService/Tokenize", start_unix_us=1).encode(),
        worker_line(request_id="other").encode(),
        worker_line().encode(),
    ]
    starts = handler_starts(log, {ID})
    assert starts == {ID: START_NS // 1000 + 30_000}
    [row] = joined([(ID, SENT_NS, FIRST_NS, EMITTED_NS)], edge_times(lines()), starts)
    # Envoy sent the request on at 19.503 ms, the handler began at 30 ms, the first message
    # was built at 262.4 ms.
    assert (row["to_handler"], row["handler_first"]) == (10.497, 232.4)
    assert row["to_handler"] + row["handler_first"] == pytest.approx(row["worker_first"])
    # Without the worker's line, no parts.
    [alone] = joined([(ID, SENT_NS, FIRST_NS, EMITTED_NS)], edge_times(lines()), {})
    assert "to_handler" not in alone and summary([alone], 1).get("to_handler") is None


def test_requests_without_a_line_or_an_emitted_time_are_left_out() -> None:
    firsts = [
        (ID, SENT_NS, FIRST_NS, 0),
        ("not-logged", SENT_NS, FIRST_NS, EMITTED_NS),
    ]
    assert joined(firsts, edge_times(lines())) == []


def test_summary_gives_each_stages_p50_and_p99_over_the_joined() -> None:
    rows = [{key: float(n) for key in [k for k, _ in STAGES] + list(PARTS)} for n in range(1, 101)]
    figures = summary(rows, requests=104)
    assert (figures["requests"], figures["joined"]) == (104, 100)
    assert figures["worker_first"] == {"p50_ms": 50.0, "p99_ms": 99.0}
    assert figures["prepare_body"] == {"p50_ms": 50.0, "p99_ms": 99.0}
    assert "ttft" not in summary([], 3)


def test_the_log_is_read_from_where_it_stood_when_opened(tmp_path: Path) -> None:
    log = tmp_path / "envoy.log"
    log.write_bytes(EDGE_LINE.encode() + b"\n")
    opened = EdgeLog(log)
    with log.open("ab") as text:
        text.write(edge_line(request_id="b2").encode() + b"\n")
    assert set(opened.times({ID, "b2"}, within=0)) == {"b2"}


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
            **summary([{key: 2.0 for key in [k for k, _ in STAGES] + list(PARTS)}], 1),
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
