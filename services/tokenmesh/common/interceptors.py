"""Server interceptors shared by every service: tracing, the RPC log line, the standard gRPC
metrics and error mapping.

Handlers must be coroutines (unary responses) or async generators (streamed responses), the
grpc.aio idioms this code base uses; the wrappers below keep that shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc import aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from prometheus_client import CollectorRegistry

from tokenmesh.common.errors import InvalidArgument, ServiceError
from tokenmesh.common.metrics import GrpcServerMetrics, MethodMetrics
from tokenmesh.common.outcome import INTERRUPTED, Deadline, final_code
from tokenmesh.common.tenants import Tenant, current_tenant, enter_tenant
from tokenmesh.common.tokens import REQUEST_ID_HEADER
from tokenmesh.common.tracing import extract, trace_id_hex

log = logging.getLogger(__name__)

UnaryBehaviour = Callable[[Any, aio.ServicerContext[Any, Any]], Awaitable[Any]]
StreamBehaviour = Callable[[Any, aio.ServicerContext[Any, Any]], AsyncIterator[Any]]


def rpc_type(handler: grpc.RpcMethodHandler) -> str:
    """The grpc_type label value for a handler: unary, client_stream, server_stream, bidi_stream."""
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


async def close(responses: AsyncIterator[Any]) -> None:
    """Close a handler's response generator now. When gRPC closes a wrapper (the caller went
    away while it was paused at a yield), `async for` would leave the inner generator open
    until garbage collection; its cleanup, such as aborting engine work, must run at once."""
    aclose = getattr(responses, "aclose", None)
    if aclose is not None:
        await aclose()


def rewrap(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[UnaryBehaviour], UnaryBehaviour],
    wrap_stream: Callable[[StreamBehaviour], StreamBehaviour],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A copy of handler whose behaviour is wrapped: wrap_unary for unary responses,
    wrap_stream for streamed responses; request_deserializer replaces the handler's."""
    serializers = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream), **serializers
        )
    return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **serializers)


# Runs before an RPC's behaviour: refuses it by raising, or admits it, returning what to call
# when it ends (None: nothing).
Admit = Callable[[aio.ServicerContext[Any, Any]], Awaitable[Callable[[], None] | None]]


def admitted(handler: grpc.RpcMethodHandler, admit: Admit) -> grpc.RpcMethodHandler:
    """handler whose behaviour first awaits admit(context), in the RPC's own task (so a
    contextvar it sets is the RPC's). An error it raises ends the RPC like the handler's would
    (inside ErrorMappingInterceptor: mapped); the release it returns runs however the RPC ends."""

    def wrap_unary(behaviour: UnaryBehaviour) -> UnaryBehaviour:
        async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            release = await admit(context)
            try:
                return await behaviour(request, context)
            finally:
                if release is not None:
                    release()

        return unary

    def wrap_stream(behaviour: StreamBehaviour) -> StreamBehaviour:
        async def stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            release = await admit(context)
            responses = behaviour(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await close(responses)
                if release is not None:
                    release()

        return stream

    return rewrap(handler, wrap_unary, wrap_stream)


def with_tenant(
    handler: grpc.RpcMethodHandler, resolve: Callable[[aio.ServicerContext[Any, Any]], Tenant]
) -> grpc.RpcMethodHandler:
    """handler whose behaviour first makes resolve(context) the RPC's tenant (resolve may
    raise a ServiceError instead, which ErrorMappingInterceptor maps)."""

    async def admit(context: aio.ServicerContext[Any, Any]) -> None:
        enter_tenant(resolve(context))

    return admitted(handler, admit)


class Malformed:
    """A request message that did not parse (not protobuf, or not this method's message)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error

    def invalid(self) -> InvalidArgument:
        return InvalidArgument("request", f"not a valid message for this method ({self.error})")


def lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """deserializer, returning Malformed instead of raising: gRPC itself would end the call
    UNKNOWN, where the caller's garbage deserves INVALID_ARGUMENT."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return Malformed(f"{type(exc).__name__}: {exc}")

    return parse


class _CheckedRequests:
    """A request stream that raises InvalidArgument at its first malformed message."""

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._requests = requests

    def __aiter__(self) -> _CheckedRequests:
        return self

    async def __anext__(self) -> Any:
        message = await self._requests.__anext__()
        if isinstance(message, Malformed):
            raise message.invalid()
        return message


def checked(request: Any, streaming: bool) -> Any:
    """The request (or request stream), refusing malformed messages."""
    if streaming:
        return _CheckedRequests(request)
    if isinstance(request, Malformed):
        raise request.invalid()
    return request


async def _abort_for(exc: Exception, context: aio.ServicerContext[Any, Any], method: str) -> None:
    """End the RPC with the status that exc stands for."""
    if isinstance(exc, ServiceError):
        trailers = (*(context.trailing_metadata() or ()), *exc.trailing_metadata)
        await context.abort(exc.code, exc.message, trailers)
    log.exception("unhandled error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class ErrorMappingInterceptor(aio.ServerInterceptor):
    """Turns ServiceError into its status code and any other exception into INTERNAL, so
    handlers raise domain errors and never pick status codes themselves; a request message
    that does not parse is INVALID_ARGUMENT."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        streaming = handler.request_streaming

        def wrap_unary(behaviour: UnaryBehaviour) -> UnaryBehaviour:
            async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                try:
                    return await behaviour(checked(request, streaming), context)
                except aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort_for(exc, context, method)

            return unary

        def wrap_stream(behaviour: StreamBehaviour) -> StreamBehaviour:
            async def stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                responses = None
                try:
                    responses = behaviour(checked(request, streaming), context)
                    async for response in responses:
                        yield response
                except aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort_for(exc, context, method)
                finally:
                    if responses is not None:
                        await close(responses)

            return stream

        return rewrap(handler, wrap_unary, wrap_stream, lenient(handler.request_deserializer))


class _CountingIterator:
    """Wraps a request stream to count received messages."""

    def __init__(self, requests: AsyncIterator[Any], received: Callable[[], None]) -> None:
        self._requests = requests
        self._received = received

    def __aiter__(self) -> _CountingIterator:
        return self

    async def __anext__(self) -> Any:
        message = await self._requests.__anext__()
        self._received()
        return message


# Methods called every few hundred milliseconds by Envoy, Kubernetes and Consul: no spans, and
# their log lines only at DEBUG.
QUIET_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Server span status per OpenTelemetry's RPC conventions: only these codes are server errors.
SERVER_ERROR_CODES = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)


def _quiet(method: str) -> bool:
    return method.startswith(QUIET_METHOD_PREFIXES)


class _RpcObserver:
    """What an observer does for one RPC: see each response, then the end, with the final
    status code and duration."""

    __slots__ = ()

    def sent(self, response: Any) -> None:
        pass

    def end(self, code: str, seconds: float) -> None:
        pass


Begin = Callable[[aio.ServicerContext[Any, Any]], Sequence[_RpcObserver]]


def _observe(
    handler: grpc.RpcMethodHandler,
    begin: Begin,
    received: Callable[[], None],
) -> grpc.RpcMethodHandler:
    """handler wrapped so that begin(context) runs as the RPC starts, in the RPC's own task, and
    the observers it returns see the responses and, last first, the end, however the RPC ends.
    received() runs for each request message. One wrapper for every observer: each layer of
    generator would cost every streamed message a hop of its own."""
    request_streaming = handler.request_streaming

    def counted(request: Any) -> Any:
        if request_streaming:
            return _CountingIterator(request, received)
        received()
        return request

    def finish(
        observers: Sequence[_RpcObserver],
        context: aio.ServicerContext[Any, Any],
        deadline: Deadline,
        error: BaseException | None,
        start: float,
    ) -> None:
        code = final_code(context, deadline, error)
        seconds = time.perf_counter() - start
        for observer in reversed(observers):
            observer.end(code, seconds)

    def wrap_unary(behaviour: UnaryBehaviour) -> UnaryBehaviour:
        async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            observers = begin(context)
            start = time.perf_counter()
            deadline = Deadline.of(context)
            error: BaseException | None = None
            try:
                response = await behaviour(counted(request), context)
                for observer in observers:
                    observer.sent(response)
                return response
            except BaseException as exc:
                error = exc
                raise
            finally:
                finish(observers, context, deadline, error, start)

        return unary

    def wrap_stream(behaviour: StreamBehaviour) -> StreamBehaviour:
        async def stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            observers = begin(context)
            start = time.perf_counter()
            deadline = Deadline.of(context)
            error: BaseException | None = None
            responses = behaviour(counted(request), context)
            try:
                async for response in responses:
                    for observer in observers:
                        observer.sent(response)
                    yield response
            except BaseException as exc:
                error = exc
                raise
            finally:
                await close(responses)
                finish(observers, context, deadline, error, start)

        return stream

    return rewrap(handler, wrap_unary, wrap_stream)


class _ServerSpan(_RpcObserver):
    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def end(self, code: str, seconds: float) -> None:
        end_server_span(self._span, code)


def end_server_span(span: Span, code: str, end_time: int | None = None) -> None:
    """End an RPC's SERVER span with its status code (now, or at end_time in ns since the
    epoch): the code as an attribute, a "cancelled" event when interrupted, ERROR status for
    a server error."""
    span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0])
    if code in INTERRUPTED:
        span.add_event("cancelled", {"tokenmesh.reason": code.lower()}, timestamp=end_time)
    if code in SERVER_ERROR_CODES:
        span.set_status(StatusCode.ERROR, code)
    span.end(end_time=end_time)


class _RpcLogLine(_RpcObserver):
    __slots__ = (
        "_level",
        "_method",
        "_peer",
        "_request_id",
        "_sent",
        "_start_unix_us",
        "_trace_id",
        "_usage",
    )

    def __init__(self, method: str, level: int, context: aio.ServicerContext[Any, Any]) -> None:
        self._method = method
        self._level = level
        # When the handler began (after gRPC took the call in), and the request id Envoy gave
        # the request: the line joins Envoy's access-log line of the same request, whose
        # times place this start (loadtests/first_token_stages.py).
        self._start_unix_us = time.time_ns() // 1000
        metadata = context.invocation_metadata() or ()
        self._request_id = next((v for k, v in metadata if k == REQUEST_ID_HEADER), None)
        self._peer = context.peer()
        self._trace_id = trace_id_hex()
        self._sent = 0
        # Prompt and completion tokens from the usage responses carry (a stream's last token,
        # a whole answer); None when the response type has no usage (looked at once).
        self._usage: list[int] | None = None

    def sent(self, response: Any) -> None:
        self._sent += 1
        if self._sent == 1:
            descriptor = getattr(type(response), "DESCRIPTOR", None)
            if descriptor is not None and "usage" in descriptor.fields_by_name:
                self._usage = [0, 0]
        if self._usage is not None and response.HasField("usage"):
            self._usage[0] += response.usage.prompt_tokens
            self._usage[1] += response.usage.completion_tokens

    def end(self, code: str, seconds: float) -> None:
        fields: dict[str, Any] = {
            "method": self._method,
            "grpc_code": code,
            "duration_ms": round(seconds * 1000, 3),
            "messages_sent": self._sent,
            "peer": self._peer,
            "start_unix_us": self._start_unix_us,
        }
        if self._request_id is not None:
            fields["request_id"] = self._request_id
        if self._trace_id is not None:
            fields["trace_id"] = self._trace_id
        if self._usage is not None:
            fields["prompt_tokens"], fields["completion_tokens"] = self._usage
        # Set by an interceptor inside this one, in the RPC's own task (so context).
        tenant = current_tenant()
        if tenant is not None:
            fields["tenant"] = tenant.id
        log.log(self._level, "rpc %s %s %.1f ms", self._method, code, seconds * 1000, extra=fields)


class _MethodCounts(_RpcObserver):
    """grpc_server_* of one RPC, and the service's own end-of-RPC accounting when it has one
    (in this observer, so a stream's messages pass no observer more)."""

    __slots__ = ("_end", "_metrics")

    def __init__(
        self, metrics: MethodMetrics, end: Callable[[str, float], None] | None = None
    ) -> None:
        self._metrics = metrics
        self._end = end
        metrics.started.inc()

    def sent(self, response: Any) -> None:
        self._metrics.sent.inc()

    def end(self, code: str, seconds: float) -> None:
        self._metrics.finish(code, seconds)
        if self._end is not None:
            self._end(code, seconds)


# For a method ('/package.Service/Method'): what to call with each of its RPCs' final code
# and seconds, or None (a service's own accounting of some methods, e.g. by token path).
Ends = Callable[[str], Callable[[str, float], None] | None]


class ObservingInterceptor(aio.ServerInterceptor):
    """What every RPC is seen by, in one wrapper, all with the same final status code:

    - a SERVER span (with a tracer), continuing the caller's trace when its metadata carries a
      W3C `traceparent`; current while the handler runs, so its own spans and outgoing calls
      (see client.TraceContextClientInterceptor) are children. Hand-written rather than
      opentelemetry-instrumentation-grpc (not in our lock): it shares this stream wrapping
      (the final code telling a cancel from a deadline, handler generators closed at once),
      takes this service's tracer rather than the global provider, and skips health checks;
    - one log line per finished RPC: method, final status code, duration, messages sent, peer,
      prompt and completion tokens (when responses carry usage), the tenant (when
      authenticated, or named by the gateway) and the trace id (when traced); health and
      reflection calls at DEBUG only;
    - grpc_server_started/handled/msg_sent/msg_received/handling_seconds per method, the names
      and labels of go-grpc-prometheus so standard dashboards work unchanged;
    - the service's own end-of-RPC accounting for the methods `ends` names.
    """

    def __init__(
        self, metrics: GrpcServerMetrics, tracer: Tracer | None = None, ends: Ends | None = None
    ) -> None:
        self._metrics = metrics
        self._tracer = tracer
        self._ends = ends

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        counts = self._metrics.for_method(method, rpc_type(handler))
        quiet = _quiet(method)
        level = logging.DEBUG if quiet else logging.INFO
        logged = log.isEnabledFor(level)
        tracer = None if quiet else self._tracer
        name = method.lstrip("/")
        service, _, rpc = name.partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}
        end = None if self._ends is None else self._ends(method)

        def begin(context: aio.ServicerContext[Any, Any]) -> list[_RpcObserver]:
            observers: list[_RpcObserver] = []
            if tracer is not None:
                parent = extract(context.invocation_metadata())
                span = tracer.start_span(
                    name, context=parent, kind=SpanKind.SERVER, attributes=attributes
                )
                # Current for the rest of the RPC (so the log line below has its trace id).
                # Never detached: each RPC runs in a task (and so a contextvars Context) of its
                # own that ends with it, and the handler's generator may be closed from another
                # task, where detaching would fail.
                otel_context.attach(trace.set_span_in_context(span, parent))
                observers.append(_ServerSpan(span))
            if logged:
                observers.append(_RpcLogLine(method, level, context))
            observers.append(_MethodCounts(counts, end))
            return observers

        return _observe(handler, begin, counts.received.inc)


def standard_interceptors(
    registry: CollectorRegistry,
    tracer: Tracer | None = None,
    inner: Sequence[aio.ServerInterceptor] = (),
    metrics: GrpcServerMetrics | None = None,
    ends: Ends | None = None,
) -> list[aio.ServerInterceptor]:
    """Every service's interceptors, outermost first: the observer (span, log line, metrics)
    sees the final status code that error mapping produced, and its span is current for
    everything inside; no tracer (tracing off): no spans at all. `inner` ones (authentication,
    tenant limits) run inside error mapping, so the errors they raise map like a handler's.
    `metrics`: the grpc_server_* set on `registry`, when the caller records in it too; `ends`:
    the service's own accounting of some methods' RPCs."""
    return [
        ObservingInterceptor(metrics or GrpcServerMetrics(registry), tracer, ends),
        ErrorMappingInterceptor(),
        *inner,
    ]
