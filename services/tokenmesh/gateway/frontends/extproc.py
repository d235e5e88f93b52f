"""Envoy's external processor: a gateway prepares Generate and OpenAI requests, workers stream."""

from __future__ import annotations

import json
import logging
import math
import struct
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.api import httpbody_pb2
from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenmesh.common.errors import DependencyError, ServiceError
from tokenmesh.common.metrics import RPC_BUCKETS
from tokenmesh.common.openai_answers import error_response
from tokenmesh.common.pools import POOL_HEADER
from tokenmesh.common.tokens import (
    CALLER_CONTENT_TYPE,
    EDGE_METADATA,
    LLM_GENERATE,
    OPENAI_CHAT_COMPLETIONS,
    OPENAI_HTTP_PATHS,
    ROUTE_HEADER,
    WORKER_GENERATE,
    WORKER_GENERATE_OPENAI,
    WORKER_HEADER,
    WORKER_REFUSED,
)
from tokenmesh.common.tracing import extract
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.prepare import PreparedCall, Preparer
from tokenmesh.gateway.core.requests import question
from tokenmesh.gateway.frontends.openai.prepare import OpenAIPreparer
from tokenmesh.gateway.frontends.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from tokenmesh.v1 import llm_pb2

log = logging.getLogger(__name__)

# How much later than an OpenAI answer's own time limit its worker call's deadline passes.
CALL_DEADLINE_SLACK_SECONDS = 5.0
PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# gRPC's length prefix: a compressed-flag byte and a 4-byte big-endian length.
PREFIX = struct.Struct(">BI")
TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# grpc-message is percent-encoded (gRPC over HTTP/2): everything but printable ASCII and '%'.
MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def grpc_frame(message: bytes) -> bytes:
    return PREFIX.pack(0, len(message)) + message


def single_message(body: bytes) -> bytes | None:
    """The one uncompressed message a unary gRPC request body holds; None for anything else
    (compressed, cut short, several), which the gateway's own handler answers as usual."""
    if len(body) < PREFIX.size:
        return None
    compressed, length = PREFIX.unpack_from(body)
    if compressed or len(body) != PREFIX.size + length:
        return None
    return body[PREFIX.size :]


def grpc_timeout(value: str | None) -> float | None:
    """Seconds of a grpc-timeout header ("100m", "5S"); None when absent or malformed."""
    if not value or value[-1] not in TIMEOUT_UNITS or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * TIMEOUT_UNITS[value[-1]]


def grpc_web(metadata: base_pb2.Metadata) -> bool:
    """Whether the caller spoke gRPC-Web (its content-type, as the edge kept it): Envoy's
    access log gets no trailers of such a stream, so its status and usage would be lost."""
    edge = metadata.filter_metadata.get(EDGE_METADATA)
    value = edge.fields.get(CALLER_CONTENT_TYPE) if edge is not None else None
    return value is not None and value.string_value.startswith("application/grpc-web")


def header_map(headers: Iterable[base_pb2.HeaderValue]) -> dict[str, str]:
    return {h.key: h.raw_value.decode() if h.raw_value else h.value for h in headers}


def header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(code: grpc.StatusCode, http: int, message: str) -> ext_proc.ProcessingResponse:
    """Envoy answers at once: gRPC callers get `code` and `message`, others HTTP `http`."""
    quoted = urllib.parse.quote(message, safe=MESSAGE_SAFE)
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=http),
            grpc_status=ext_proc.GrpcStatus(status=code.value[0]),
            headers=ext_proc.HeaderMutation(set_headers=[header("grpc-message", quoted)]),
        )
    )


class Unprepared(Exception):
    """A body that is not one uncompressed GenerateRequest: the gateway's handler takes it."""


class DirectMetrics:
    """Generate requests the gateway prepared for Envoy to stream straight from a worker."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "tokenmesh_gateway_direct_requests",
            "Generate (api=grpc) and OpenAI completions (api=openai) requests seen as Envoy's "
            "external processor, by outcome: direct (streamed from a worker by Envoy), gateway "
            "(left to the gateway's own handler: quotas on, gRPC-Web, or a request it "
            "refuses), refused (neither).",
            ["api", "outcome"],
            registry=registry,
        )
        self.logged = Counter(
            "tokenmesh_gateway_direct_streams_logged",
            "Streams to workers (api=grpc: Generate, api=openai: OpenAI completions) whose end "
            "an edge Envoy (envoy: its node id) reported to this gateway in its access log. "
            "Summed over the gateways it follows that Envoy's "
            "envoy_access_logs_grpc_access_log_logs_written a second or so behind; a gap that "
            "stays open is entries lost.",
            ["api", "envoy"],
            registry=registry,
        )
        self.prepare_seconds = Histogram(
            "tokenmesh_gateway_direct_prepare_seconds",
            "Time from a request's headers to its prepared worker request.",
            buckets=RPC_BUCKETS,
            registry=registry,
        )


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """For each Generate request Envoy sends its headers, then its whole body; the gateway
    validates it and builds the worker's request as its own handler would (context documents,
    reranker, prompt, warnings), and Envoy sends that to a worker and streams the worker's
    tokens to the caller, with no gateway on the way. Requests whose tokens the gateway must
    see (quotas: a keys file is configured; gRPC-Web, whose trailers Envoy's access log never
    gets), that it cannot read here (compressed) or would refuse go on unchanged, to its own
    handler."""

    def __init__(
        self,
        preparer: Preparer,
        settings: GatewaySettings,
        metrics: DirectMetrics,
        tracer: Tracer | None = None,
        openai: OpenAIPreparer | None = None,
        metered: bool = False,
    ) -> None:
        self._preparer = preparer
        # Token quotas are on: the gateway must see every token, so it serves every request.
        self._metered = metered
        self._settings = settings
        self._metrics = metrics
        self._tracer = tracer
        self._openai = openai

    async def Process(
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: Any
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        started = time.monotonic()
        headers: dict[str, str] = {}
        openai = False
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                headers = header_map(message.request_headers.headers.headers)
                path = headers.get(":path", "")
                openai = path in OPENAI_HTTP_PATHS
                if openai:
                    # Whatever becomes of it is decided on its body.
                    yield ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
                    continue
                if path != LLM_GENERATE:
                    # Only Generate is processed; a caller asking the edge for the workers'
                    # own method gets what the gateway says of methods it does not serve.
                    self._metrics.requests.labels(api="grpc", outcome="refused").inc()
                    yield immediate(grpc.StatusCode.UNIMPLEMENTED, 501, f"{path}: not served here")
                    return
                yield ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
                if (
                    self._metered
                    or message.request_headers.end_of_stream
                    or grpc_web(message.metadata_context)
                ):
                    # Closing the stream lets Envoy go on unprocessed, to the gateway's handler.
                    self._metrics.requests.labels(api="grpc", outcome="gateway").inc()
                    return
            elif kind == "request_body" and openai:
                response, direct = await self._openai_request(
                    headers, message.request_body, started
                )
                yield response
                if not direct:
                    return
            elif kind == "response_headers" and openai:
                yield answered(header_map(message.response_headers.headers.headers))
                return
            elif kind == "request_body":
                body = message.request_body
                if not body.end_of_stream:
                    # Not the whole body (Envoy buffers it whole; a larger one it refuses):
                    # nothing to prepare from, so the gateway's handler takes the request.
                    self._metrics.requests.labels(api="grpc", outcome="gateway").inc()
                    yield ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
                    return
                yield await self._prepared(headers, body.body, started)
                return
            else:
                log.warning("external processor: unexpected %s", kind)
                return

    async def _prepared(
        self, headers: dict[str, str], body: bytes, started: float
    ) -> ext_proc.ProcessingResponse:
        """The rewritten request; or, for one the gateway cannot read here or would refuse,
        the request unchanged: the gateway's own handler answers it (with the status and
        message it gives on every protocol: gRPC, gRPC-Web, REST)."""
        data = single_message(body)
        try:
            if data is None:
                raise Unprepared
            mutation, worker_body = await self._worker_request(headers, data, started)
        except (ServiceError, Unprepared):
            self._metrics.requests.labels(api="grpc", outcome="gateway").inc()
            return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
        self._metrics.requests.labels(api="grpc", outcome="direct").inc()
        self._metrics.prepare_seconds.observe(time.monotonic() - started)
        return rewritten(mutation, worker_body)

    async def _worker_request(
        self, headers: dict[str, str], data: bytes, started: float
    ) -> tuple[ext_proc.HeaderMutation, bytes]:
        try:
            request = llm_pb2.GenerateRequest.FromString(data)
        except DecodeError as exc:
            raise Unprepared from exc
        timeout = grpc_timeout(headers.get("grpc-timeout"))
        remaining = None if timeout is None else timeout - (time.monotonic() - started)
        asked = question(request, self._settings)
        call = await self._traced(headers, self._preparer.question(asked, remaining))
        # grpc-timeout goes on unchanged: the worker's clock starts later than the caller's,
        # so the caller's deadline (its own timer, and Envoy's max_stream_duration) ends the
        # stream first, with DEADLINE_EXCEEDED, and the reset aborts the engine request.
        return worker_headers(WORKER_GENERATE, call), grpc_frame(call.request.SerializeToString())

    async def _openai_request(
        self, headers: dict[str, str], body: ext_proc.HttpBody, started: float
    ) -> tuple[ext_proc.ProcessingResponse, bool]:
        """The worker's request for an OpenAI completion, and True; or, when the gateway must
        see its tokens (keys: quotas), cannot read it here or would refuse it, the request
        handed back to the gateway's own HTTP API as the caller sent it, and False."""
        path = headers[":path"]
        data = single_message(body.body) if body.end_of_stream else None
        try:
            caller = httpbody_pb2.HttpBody.FromString(data) if data is not None else None
        except DecodeError:
            caller = None
        if caller is None:
            # Not one whole HttpBody (the transcoder sends the whole body as one): nothing to
            # hand back either; the route's own answer stands.
            self._metrics.requests.labels(api="openai", outcome="gateway").inc()
            return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse()), False
        try:
            if self._openai is None or self._metered:
                raise Unprepared
            kind = ChatCompletionRequest if path == OPENAI_CHAT_COMPLETIONS else CompletionRequest
            call = await self._traced(headers, self._openai.prepare(parse(kind, caller.data)))
        except (ServiceError, Unprepared):
            self._metrics.requests.labels(api="openai", outcome="gateway").inc()
            return handed_back(OPENAI_HTTP_PATHS[path], caller), False
        # The worker ends the answer at its time limit (a stream with the error as its last
        # event); the call's deadline, a little later, only backs it up.
        limit = call.request.openai.time_limit_seconds
        mutation = worker_headers(
            WORKER_GENERATE_OPENAI,
            call,
            header(ROUTE_HEADER, OPENAI_HTTP_PATHS[path]),
            header("grpc-timeout", f"{math.ceil(limit + CALL_DEADLINE_SLACK_SECONDS)}S"),
        )
        self._metrics.requests.labels(api="openai", outcome="direct").inc()
        self._metrics.prepare_seconds.observe(time.monotonic() - started)
        return rewritten(mutation, grpc_frame(call.request.SerializeToString())), True

    async def _traced(
        self, headers: dict[str, str], preparing: Awaitable[PreparedCall]
    ) -> PreparedCall:
        """A preparation, in the caller's trace when tracing is on (its traceparent is among
        the request's headers): beside the stream's own span (accesslog.py) and the worker's,
        with the reranker call inside."""
        if self._tracer is None:
            return await preparing
        span = self._tracer.start_span(
            "prepare", context=extract(headers.items()), kind=SpanKind.INTERNAL
        )
        with trace.use_span(span, end_on_exit=True):
            prepared = await preparing
            span.set_attribute("tokenmesh.degraded", prepared.degraded)
        return prepared


def worker_headers(
    path: str, call: PreparedCall, *extra: base_pb2.HeaderValueOption
) -> ext_proc.HeaderMutation:
    """The headers of a request rewritten for the workers' `path`, with the call's routing."""
    routing = [header(name, value) for name, value in call.routing_headers()]
    # A caller's own worker or pool choice never reaches Envoy's routing (Envoy removes before
    # it sets): each header is set again when the call names a worker or a further pool.
    return ext_proc.HeaderMutation(
        set_headers=[header(":path", path), *routing, *extra],
        remove_headers=[WORKER_HEADER, POOL_HEADER],
    )


def rewritten(mutation: ext_proc.HeaderMutation, body: bytes) -> ext_proc.ProcessingResponse:
    """The request with new headers and body, routed again on its new path."""
    return ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(
            response=ext_proc.CommonResponse(
                header_mutation=mutation,
                body_mutation=ext_proc.BodyMutation(body=body),
                clear_route_cache=True,
            )
        )
    )


def handed_back(path: str, caller: httpbody_pb2.HttpBody) -> ext_proc.ProcessingResponse:
    """The caller's own HTTP request again (its path, content-type and JSON body), routed
    anew: to the gateways' HTTP API, which answers it."""
    mutation = ext_proc.HeaderMutation(
        set_headers=[
            header(":path", path),
            header("content-type", caller.content_type or "application/json"),
        ],
        remove_headers=["te"],
    )
    return rewritten(mutation, caller.data)


def answered(headers: dict[str, str]) -> ext_proc.ProcessingResponse:
    """A worker's answer to an OpenAI completion, at its headers: one it refused before
    answering (a gRPC status in the headers) becomes OpenAI's error object with its HTTP
    status, as the gateway's own HTTP API answers it; any other goes on unchanged."""
    code = headers.get("grpc-status")
    if code is None or code == "0":
        return ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
    status_code = next((c for c in grpc.StatusCode if str(c.value[0]) == code), None)
    message = urllib.parse.unquote(headers.get("grpc-message", ""))
    error = DependencyError(status_code or grpc.StatusCode.UNKNOWN, message)
    status, body, extra = error_response(error)
    mutation = ext_proc.HeaderMutation(
        set_headers=[header("content-type", "application/json")]
        + [header(k.decode(), v.decode()) for k, v in extra]
    )
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation,
            body=json.dumps(body, separators=(",", ":")).encode(),
            details=WORKER_REFUSED,
        )
    )
