"""Envoy's access log of the streams it sent straight from a worker: the gateway's metrics."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf.duration_pb2 import Duration
from opentelemetry.trace import SpanKind, Tracer
from prometheus_client import Counter

from tokenmesh.common.errors import HTTP_STATUS
from tokenmesh.common.interceptors import end_server_span
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.outcome import Deadline, ended
from tokenmesh.common.tokens import (
    AFFINITY_HEADER,
    EDGE_METADATA,
    EDGE_WORKER,
    LLM_GENERATE,
    ROUTE_HEADER,
    USAGE_TRAILER,
    WORKER_GENERATE,
    WORKER_GENERATE_OPENAI,
    parse_usage_trailer,
)
from tokenmesh.common.tracing import extract
from tokenmesh.gateway.frontends.calls import DIRECT_PATH, CallMetrics
from tokenmesh.gateway.frontends.extproc import grpc_timeout
from tokenmesh.gateway.frontends.openai.http import HttpMetrics

log = logging.getLogger(__name__)

CODE_NAMES: dict[int, str] = {code.value[0]: code.name for code in grpc.StatusCode}
GENERATE_METHOD = LLM_GENERATE.rpartition("/")[2]


def seconds(duration: Duration) -> float:
    return float(duration.seconds + duration.nanos / 1e9)


def final_code(entry: accesslog_pb2.HTTPAccessLogEntry, duration: float) -> str:
    """The status the caller saw (common/outcome.py's rule): the worker's (or Envoy's)
    grpc-status, in the trailers or a trailers-only answer's headers; for a stream reset
    before its end, the caller's deadline passing or its cancel; a worker that went away is
    UNAVAILABLE."""
    response = entry.response
    status: str | None = response.response_trailers.get(
        "grpc-status"
    ) or response.response_headers.get("grpc-status")
    code = CODE_NAMES.get(int(status), "UNKNOWN") if status and status.isdigit() else None
    flags = entry.common_properties.response_flags
    timeout = grpc_timeout(entry.request.request_headers.get("grpc-timeout"))
    interrupted = code is None and (
        flags.downstream_remote_reset or flags.downstream_connection_termination
    )
    broken = (
        flags.upstream_remote_reset
        or flags.upstream_connection_termination
        or flags.upstream_connection_failure
        or flags.no_healthy_upstream
    )
    return ended(
        code, Deadline.after(timeout, duration), interrupted, "UNAVAILABLE" if broken else "UNKNOWN"
    )


class DirectStreamLog(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's edge logs each Generate stream it sent straight from a worker (the direct token
    path) here, a second or less after it ends, and the gateway records it beside the streams
    it serves itself: tokenmesh_gateway_calls_total and _call_seconds with path="direct" (the
    OpenAI API's requests by route, status and path), tokenmesh_ttft_seconds,
    tokenmesh_request_duration_seconds,
    tokenmesh_tokens_generated and tokenmesh_prompt_tokens, with Envoy's own timings (time to
    the first byte sent to the caller: the worker sends its headers with its first token).
    Tokens are counted from the worker's usage trailer, so a stream cut short counts none here;
    inter-token gaps are the worker's to record (it sees every message; no gateway does).
    With a tracer, each stream is also a SERVER span in the caller's trace (Envoy logs its
    traceparent), timed by Envoy, with its status and a "cancelled" event as on other RPCs."""

    def __init__(
        self,
        streams: StreamMetrics,
        calls: CallMetrics,
        tracer: Tracer | None = None,
        http: HttpMetrics | None = None,
        logged: Counter | None = None,
    ) -> None:
        self._streams = streams
        self._logged = logged
        self._calls = calls
        self._tracer = tracer
        self._http = http

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        envoy = ""  # the sending Envoy's node id: in a stream's first message only
        async for message in request_iterator:
            if message.HasField("identifier"):
                envoy = message.identifier.node.id
            for entry in message.http_logs.log_entry:
                self.record(entry, envoy)
        return als_pb2.StreamAccessLogsResponse()

    def record(self, entry: accesslog_pb2.HTTPAccessLogEntry, envoy: str = "") -> None:
        path = entry.request.path
        if path not in (WORKER_GENERATE, WORKER_GENERATE_OPENAI):
            return
        common = entry.common_properties
        if common.HasField("duration"):
            duration = seconds(common.duration)
        else:
            duration = seconds(common.time_to_last_downstream_tx_byte)
        code = final_code(entry, duration)
        openai = path == WORKER_GENERATE_OPENAI
        if self._logged is not None:
            self._logged.labels("openai" if openai else "grpc", envoy).inc()
        usage = parse_usage_trailer(entry.response.response_trailers.get(USAGE_TRAILER, ""))
        if openai:
            self._record_http(entry, code, duration)
        else:
            self._calls.record(GENERATE_METHOD, DIRECT_PATH, code, duration)
        streams = self._streams
        if entry.response.response_body_bytes and common.HasField(
            "time_to_first_downstream_tx_byte"
        ):
            streams.ttft.observe(seconds(common.time_to_first_downstream_tx_byte))
        if usage is not None:
            prompt_tokens, completion_tokens, _ = usage
            streams.prompt_tokens.inc(prompt_tokens)
            streams.tokens.inc(completion_tokens)
        streams.duration.labels(code).observe(duration)
        if self._tracer is not None:
            self._span(self._tracer, entry, code, duration, openai)
        log.debug(
            "direct stream %s %.1f ms",
            code,
            duration * 1000,
            extra={"grpc_code": code, "duration_ms": round(duration * 1000, 3)},
        )

    def _record_http(
        self, entry: accesslog_pb2.HTTPAccessLogEntry, code: str, duration: float
    ) -> None:
        """An OpenAI request a worker answered, counted by route and HTTP status as the
        gateway's own HTTP API counts them: a refusal's status as the caller got it, 499
        for a caller that went away, an error in a begun stream by its code."""
        if self._http is None:
            return
        route = entry.request.request_headers.get(ROUTE_HEADER, "")
        status = entry.response.response_code.value
        if status in (0, 200):  # 0: none sent, the caller went away first
            status = HTTP_STATUS.get(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), 500)
        self._http.record(route, status, DIRECT_PATH, duration)

    @staticmethod
    def _span(
        tracer: Tracer,
        entry: accesslog_pb2.HTTPAccessLogEntry,
        code: str,
        duration: float,
        openai: bool,
    ) -> None:
        start = entry.common_properties.start_time.ToNanoseconds()
        end = start + int(duration * 1e9)
        if openai:
            route = entry.request.request_headers.get(ROUTE_HEADER, "")
            name = f"POST {route}"
            attributes = {"http.request.method": "POST", "http.route": route}
        else:
            service, _, method = LLM_GENERATE.lstrip("/").partition("/")
            name = LLM_GENERATE.lstrip("/")
            attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        span = tracer.start_span(
            name,
            context=extract(entry.request.request_headers.items()),
            kind=SpanKind.SERVER,
            attributes={**attributes, "tokenmesh.direct": True, **routed(entry)},
            start_time=start,
        )
        end_server_span(span, code, end)


def routed(entry: accesslog_pb2.HTTPAccessLogEntry) -> dict[str, str]:
    """How Envoy chose the stream's worker: the prefix-affinity key it hashed (worker_routing
    prefix) and the worker it picked (the last one, after any retries)."""
    attributes = {}
    key = entry.request.request_headers.get(AFFINITY_HEADER)
    if key:
        attributes["tokenmesh.affinity_key"] = key
    # The edge keeps the worker its answer named (through the stream relay, whose address is
    # the edge's upstream, as through the router).
    edge = entry.common_properties.metadata.filter_metadata.get(EDGE_METADATA)
    worker = edge.fields[EDGE_WORKER].string_value if edge and EDGE_WORKER in edge.fields else ""
    upstream = entry.common_properties.upstream_remote_address.socket_address
    if worker:
        attributes["tokenmesh.worker"] = worker
    elif upstream.address:
        attributes["tokenmesh.worker"] = f"{upstream.address}:{upstream.port_value}"
    return attributes
