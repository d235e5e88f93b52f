"""The gateway's metrics for streams Envoy sent straight from a worker, from Envoy's access log."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from grpc import aio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.tokens import (
    AFFINITY_HEADER,
    EDGE_METADATA,
    EDGE_WORKER,
    ROUTE_HEADER,
    USAGE_TRAILER,
    WORKER_GENERATE_OPENAI,
    parse_usage_trailer,
    usage_trailer,
)
from tokenmesh.gateway.frontends.calls import CallMetrics
from tokenmesh.gateway.frontends.direct_log import DirectStreamLog
from tokenmesh.gateway.frontends.extproc import DirectMetrics
from tokenmesh.gateway.frontends.openai.http import HttpMetrics

# The public call a direct stream is: Generate, on the direct path.
GENERATE = {"grpc_service": "tokenmesh.v1.LLMService", "grpc_method": "Generate", "path": "direct"}
CALLS = "tokenmesh_gateway_calls_total"


def entry(
    *,
    path: str = "/tokenmesh.v1.InferenceService/Generate",
    duration: float = 1.5,
    first_byte: float | None = 0.25,
    body_bytes: int = 900,
    trailers: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    timeout: str | None = None,
    **flags: bool,
) -> accesslog_pb2.HTTPAccessLogEntry:
    log = accesslog_pb2.HTTPAccessLogEntry()
    log.request.path = path
    if timeout is not None:
        log.request.request_headers["grpc-timeout"] = timeout
    log.common_properties.duration.FromNanoseconds(int(duration * 1e9))
    if first_byte is not None:
        log.common_properties.time_to_first_downstream_tx_byte.FromNanoseconds(
            int(first_byte * 1e9)
        )
    for flag, value in flags.items():
        setattr(log.common_properties.response_flags, flag, value)
    log.response.response_code.value = 200
    log.response.response_body_bytes = body_bytes
    log.response.response_trailers.update(trailers or {})
    log.response.response_headers.update(headers or {})
    return log


def traced_log() -> tuple[DirectStreamLog, InMemorySpanExporter]:
    """A log whose spans end up in the returned exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    log = DirectStreamLog(
        StreamMetrics(registry), CallMetrics(registry), provider.get_tracer("test")
    )
    return log, exporter


class Recorded:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.log = DirectStreamLog(StreamMetrics(self.registry), CallMetrics(self.registry))

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def test_a_finished_stream_counts_as_the_gateways_own() -> None:
    seen = Recorded()
    usage = usage_trailer(prompt_tokens=12, completion_tokens=128, messages=40)
    seen.log.record(entry(trailers={"grpc-status": "0", USAGE_TRAILER: usage}))
    assert seen.value(CALLS, **GENERATE, grpc_code="OK") == 1
    seconds = {"grpc_method": "Generate", "path": "direct"}
    assert seen.value("tokenmesh_gateway_call_seconds_sum", **seconds) == pytest.approx(1.5)
    assert seen.value("tokenmesh_ttft_seconds_count") == 1
    assert seen.value("tokenmesh_ttft_seconds_sum") == pytest.approx(0.25)
    assert seen.value("tokenmesh_tokens_generated_total") == 128
    assert seen.value("tokenmesh_prompt_tokens_total") == 12
    assert seen.value("tokenmesh_request_duration_seconds_count", grpc_code="OK") == 1
    # No gateway saw the gaps between messages: the worker records them.
    assert seen.value("tokenmesh_inter_token_latency_seconds_count") == 0


def test_an_error_answered_before_any_token_has_no_first_token() -> None:
    seen = Recorded()
    # Trailers-only: the status comes in the headers, and no message was sent.
    seen.log.record(entry(body_bytes=0, headers={"grpc-status": "8"}, trailers={}))
    assert seen.value(CALLS, **GENERATE, grpc_code="RESOURCE_EXHAUSTED") == 1
    assert seen.value("tokenmesh_ttft_seconds_count") == 0
    assert seen.value("tokenmesh_tokens_generated_total") == 0


@pytest.mark.parametrize(
    ("timeout", "duration", "flags", "code"),
    [
        ("500m", 0.5, {"downstream_remote_reset": True}, "DEADLINE_EXCEEDED"),
        ("500m", 0.45, {"downstream_remote_reset": True}, "DEADLINE_EXCEEDED"),  # its slack
        ("5S", 0.5, {"downstream_remote_reset": True}, "CANCELLED"),
        (None, 0.5, {"downstream_connection_termination": True}, "CANCELLED"),
        (None, 0.5, {"upstream_remote_reset": True}, "UNAVAILABLE"),
        (None, 0.5, {}, "UNKNOWN"),
    ],
)
def test_a_stream_cut_short_ends_as_the_caller_saw_it(
    timeout: str | None, duration: float, flags: dict[str, bool], code: str
) -> None:
    seen = Recorded()
    seen.log.record(entry(timeout=timeout, duration=duration, trailers={}, **flags))
    assert seen.value(CALLS, **GENERATE, grpc_code=code) == 1
    assert seen.value("tokenmesh_request_duration_seconds_count", grpc_code=code) == 1
    # Cut short: the worker sent no usage, so no tokens are counted here.
    assert seen.value("tokenmesh_tokens_generated_total") == 0
    assert seen.value("tokenmesh_ttft_seconds_count") == 1  # a token had been sent


def test_other_paths_and_malformed_usage_are_not_counted() -> None:
    seen = Recorded()
    seen.log.record(entry(path="/tokenmesh.v1.LLMService/Generate"))
    assert seen.value(CALLS, **GENERATE, grpc_code="OK") == 0
    seen.log.record(entry(trailers={"grpc-status": "0", USAGE_TRAILER: "12 x 3"}))
    assert seen.value(CALLS, **GENERATE, grpc_code="OK") == 1
    assert seen.value("tokenmesh_tokens_generated_total") == 0


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("12 128 40", (12, 128, 40)), ("12 128", None), ("", None), ("1 -2 3", None)],
)
def test_the_usage_trailer(value: str, parsed: tuple[int, int, int] | None) -> None:
    assert parse_usage_trailer(value) == parsed
    if parsed is not None:
        assert usage_trailer(*parsed) == value


async def test_envoys_log_stream_is_served_over_grpc() -> None:
    """The service as Envoy calls it: a client stream of batches of entries."""
    seen = Recorded()
    server = aio.server()
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(seen.log, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        usage = usage_trailer(prompt_tokens=3, completion_tokens=7, messages=7)
        finished = entry(trailers={"grpc-status": "0", USAGE_TRAILER: usage})

        async def batches() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
            for _ in range(2):
                message = als_pb2.StreamAccessLogsMessage()
                message.identifier.log_name = "direct_streams"
                message.http_logs.log_entry.extend([finished, finished])
                yield message

        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = als_pb2_grpc.AccessLogServiceStub(channel)
            await stub.StreamAccessLogs(batches())
    finally:
        await server.stop(None)
    assert seen.value(CALLS, **GENERATE, grpc_code="OK") == 4
    assert seen.value("tokenmesh_tokens_generated_total") == 28


def test_each_stream_is_a_span_in_the_callers_trace() -> None:
    log, exporter = traced_log()
    trace_id, caller = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    cancelled = entry(duration=0.75, trailers={}, downstream_remote_reset=True)
    cancelled.request.request_headers["traceparent"] = f"00-{trace_id}-{caller}-01"
    cancelled.common_properties.start_time.FromNanoseconds(1_000_000_000)
    log.record(cancelled)
    (span,) = exporter.get_finished_spans()
    assert span.name == "tokenmesh.v1.LLMService/Generate"
    assert f"{span.context.trace_id:032x}" == trace_id
    assert span.parent is not None and f"{span.parent.span_id:016x}" == caller
    assert (span.start_time, span.end_time) == (1_000_000_000, 1_750_000_000)
    assert span.attributes is not None and span.attributes["rpc.grpc.status_code"] == 1
    assert [event.name for event in span.events] == ["cancelled"]


def test_an_openai_answer_counts_as_the_gateways_http_api_counts_its_own() -> None:
    """By route and HTTP status as the caller got it (a refusal the external processor
    answered, a begun stream's end by its code, 499 for a caller gone), with its tokens; not
    as LLMService/Generate."""
    registry = CollectorRegistry()
    log = DirectStreamLog(
        StreamMetrics(registry), CallMetrics(registry), None, HttpMetrics(registry)
    )
    chat = {ROUTE_HEADER: "/v1/chat/completions"}
    usage = usage_trailer(prompt_tokens=14, completion_tokens=8, messages=8)
    answers = [
        entry(headers=chat, trailers={"grpc-status": "0", USAGE_TRAILER: usage}),
        entry(headers=chat, trailers={"grpc-status": "4"}),
        entry(headers=chat, trailers={}, downstream_remote_reset=True),
    ]
    refused = entry(headers=chat, body_bytes=0, first_byte=None, trailers={})
    refused.response.response_code.value = 400
    for answer in [*answers, refused]:
        answer.request.path = WORKER_GENERATE_OPENAI
        answer.request.request_headers.update(chat)
        log.record(answer)

    def requests(status: str) -> float:
        labels = {"route": "/v1/chat/completions", "status": status, "path": "direct"}
        return registry.get_sample_value("tokenmesh_gateway_http_requests_total", labels) or 0.0

    assert [requests(s) for s in ("200", "504", "499", "400")] == [1, 1, 1, 1]
    assert registry.get_sample_value("tokenmesh_tokens_generated_total") == 8
    assert registry.get_sample_value("tokenmesh_ttft_seconds_count") == 3
    assert (registry.get_sample_value(CALLS, {**GENERATE, "grpc_code": "OK"}) or 0) == 0


async def test_each_envoys_entries_are_counted_by_its_node_id_and_api() -> None:
    """What a test (or an operator) compares with that Envoy's logs_written: the node id comes
    in a stream's first message only."""
    registry = CollectorRegistry()
    logged = DirectMetrics(registry).logged
    log = DirectStreamLog(StreamMetrics(registry), CallMetrics(registry), logged=logged)

    def message(*entries: accesslog_pb2.HTTPAccessLogEntry, node: str | None = None) -> Any:
        sent = als_pb2.StreamAccessLogsMessage()
        if node is not None:
            sent.identifier.node.id = node
        sent.http_logs.log_entry.extend(entries)
        return sent

    openai = entry(path=WORKER_GENERATE_OPENAI, trailers={"grpc-status": "0"})
    generate = entry(trailers={"grpc-status": "0"})

    async def stream(*messages: Any) -> AsyncIterator[Any]:
        for sent in messages:
            yield sent

    await log.StreamAccessLogs(
        stream(message(generate, node="edge-a"), message(generate, openai)), None
    )
    await log.StreamAccessLogs(stream(message(openai, node="edge-b")), None)

    def count(api: str, envoy: str) -> float:
        labels = {"api": api, "envoy": envoy}
        return registry.get_sample_value("tokenmesh_gateway_direct_streams_logged_total", labels)

    assert (count("grpc", "edge-a"), count("openai", "edge-a")) == (2, 1)
    assert count("openai", "edge-b") == 1


def test_the_span_names_the_affinity_key_and_the_worker_envoy_chose() -> None:
    log, exporter = traced_log()
    routed = entry(trailers={"grpc-status": "0"})
    routed.request.request_headers[AFFINITY_HEADER] = "5f2b8c0d1e3a4b6c"
    upstream = routed.common_properties.upstream_remote_address.socket_address
    upstream.address, upstream.port_value = "10.1.2.3", 50061
    log.record(routed)
    log.record(entry(trailers={"grpc-status": "14"}))  # no worker reached, no key
    first, second = exporter.get_finished_spans()
    assert first.attributes is not None and second.attributes is not None
    assert first.attributes["tokenmesh.affinity_key"] == "5f2b8c0d1e3a4b6c"
    assert first.attributes["tokenmesh.worker"] == "10.1.2.3:50061"
    assert "tokenmesh.affinity_key" not in second.attributes
    assert "tokenmesh.worker" not in second.attributes


def test_through_the_stream_relay_the_span_names_the_worker_the_edge_kept() -> None:
    """The edge's upstream is the relay's internal listener (no socket address): the worker
    is the one its answer named, which the edge keeps in its metadata."""
    log, exporter = traced_log()
    relayed = entry(trailers={"grpc-status": "0"})
    relayed.common_properties.metadata.filter_metadata[EDGE_METADATA].fields[
        EDGE_WORKER
    ].string_value = "10.1.2.4:50062"
    log.record(relayed)
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["tokenmesh.worker"] == "10.1.2.4:50062"
