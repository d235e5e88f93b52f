"""grpc.aio client interceptors for calls to other services: grpc_client_* metrics, traceparent."""

# Hand-written rather than opentelemetry-instrumentation-grpc or py-grpc-prometheus (which has
# no grpc.aio interceptors: lchenn/py-grpc-prometheus#13 is open): the metrics mirror our
# server-side set exactly, propagation must use this service's tracer rather than a global
# provider, and cancellation must stay immediate. Both interceptors hand the underlying call
# back (metrics wraps only its response iterator), so `call.cancel()` on what the stub returns
# still cancels the RPC at once; completion is taken from the call's done callback, which fires
# on cancel too.

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from tokenmesh.common.metrics import GrpcClientMetrics, MethodMetrics
from tokenmesh.common.tracing import Tracing, outgoing_metadata

Continuation = Callable[[aio.ClientCallDetails, Any], Awaitable[Any]]


def _method(details: aio.ClientCallDetails) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


class ClientMetricsInterceptor:
    """grpc_client_started/handled/msg_sent/msg_received/handling_seconds per method, named and
    labelled like the server-side set (go-grpc-prometheus)."""

    def __init__(self, metrics: GrpcClientMetrics) -> None:
        self._metrics = metrics
        # Tasks reading final status codes, kept referenced until they finish.
        self._finishing: set[asyncio.Task[None]] = set()

    def _begin(self, details: aio.ClientCallDetails, grpc_type: str) -> MethodMetrics:
        metrics = self._metrics.for_method(_method(details), grpc_type)
        metrics.started.inc()
        return metrics

    def _on_done(self, call: Any, metrics: MethodMetrics, start: float, unary: bool) -> None:
        """Record the end when the call ends (completes, fails, is cancelled or times out)."""

        async def finish() -> None:
            code = await call.code()
            if unary and code is grpc.StatusCode.OK:
                metrics.received.inc()
            metrics.finish(code.name, time.perf_counter() - start)

        def done(_: Any) -> None:
            # The status is final here; reading it is a coroutine, so in a task of its own.
            task = asyncio.get_running_loop().create_task(finish())
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

        call.add_done_callback(done)

    async def _counted_responses(self, call: Any, metrics: MethodMetrics) -> AsyncIterator[Any]:
        async for response in call:
            metrics.received.inc()
            yield response

    async def _counted_requests(
        self, requests: AsyncIterator[Any], metrics: MethodMetrics
    ) -> AsyncIterator[Any]:
        async for request in requests:
            metrics.sent.inc()
            yield request

    async def intercept_unary_unary(
        self, continuation: Continuation, client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        metrics = self._begin(client_call_details, "unary")
        start = time.perf_counter()
        call = await continuation(client_call_details, request)
        metrics.sent.inc()
        self._on_done(call, metrics, start, unary=True)
        return call

    async def intercept_unary_stream(
        self, continuation: Continuation, client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        metrics = self._begin(client_call_details, "server_stream")
        start = time.perf_counter()
        call = await continuation(client_call_details, request)
        metrics.sent.inc()
        self._on_done(call, metrics, start, unary=False)
        return self._counted_responses(call, metrics)

    async def intercept_stream_unary(
        self,
        continuation: Continuation,
        client_call_details: aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        metrics = self._begin(client_call_details, "client_stream")
        start = time.perf_counter()
        call = await continuation(
            client_call_details, self._counted_requests(request_iterator, metrics)
        )
        self._on_done(call, metrics, start, unary=True)
        return call

    async def intercept_stream_stream(
        self,
        continuation: Continuation,
        client_call_details: aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        metrics = self._begin(client_call_details, "bidi_stream")
        start = time.perf_counter()
        call = await continuation(
            client_call_details, self._counted_requests(request_iterator, metrics)
        )
        self._on_done(call, metrics, start, unary=False)
        return self._counted_responses(call, metrics)


class TraceContextClientInterceptor:
    """Adds `traceparent` for the current span to every call's metadata, so the callee's
    server span (through Envoy, which passes the header on) continues this trace. The call is
    made in a task copied from the caller's context, so the current span is the caller's."""

    def _with_trace(self, details: aio.ClientCallDetails) -> aio.ClientCallDetails:
        headers = outgoing_metadata()
        if not headers:
            return details
        metadata = aio.Metadata(*(details.metadata or ()), *headers)
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(
        self, continuation: Continuation, client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._with_trace(client_call_details), request)

    async def intercept_unary_stream(
        self, continuation: Continuation, client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._with_trace(client_call_details), request)

    async def intercept_stream_unary(
        self,
        continuation: Continuation,
        client_call_details: aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(self._with_trace(client_call_details), request_iterator)

    async def intercept_stream_stream(
        self,
        continuation: Continuation,
        client_call_details: aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(self._with_trace(client_call_details), request_iterator)


class _UnaryUnary(aio.UnaryUnaryClientInterceptor):
    def __init__(self, interceptor: _AnyArity) -> None:
        self._interceptor = interceptor

    async def intercept_unary_unary(
        self, continuation: Continuation, client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await self._interceptor.intercept_unary_unary(
            continuation, client_call_details, request
        )


class _UnaryStream(aio.UnaryStreamClientInterceptor):
    def __init__(self, interceptor: _AnyArity) -> None:
        self._interceptor = interceptor

    async def intercept_unary_stream(
        self, continuation: Continuation, client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await self._interceptor.intercept_unary_stream(
            continuation, client_call_details, request
        )


class _StreamUnary(aio.StreamUnaryClientInterceptor):
    def __init__(self, interceptor: _AnyArity) -> None:
        self._interceptor = interceptor

    async def intercept_stream_unary(
        self, continuation: Continuation, client_call_details: aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await self._interceptor.intercept_stream_unary(
            continuation, client_call_details, requests
        )


class _StreamStream(aio.StreamStreamClientInterceptor):
    def __init__(self, interceptor: _AnyArity) -> None:
        self._interceptor = interceptor

    async def intercept_stream_stream(
        self, continuation: Continuation, client_call_details: aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await self._interceptor.intercept_stream_stream(
            continuation, client_call_details, requests
        )


_AnyArity = ClientMetricsInterceptor | TraceContextClientInterceptor


def for_every_arity(interceptor: _AnyArity) -> list[aio.ClientInterceptor]:
    """interceptor as the four per-arity objects a channel takes: grpc.aio files an object
    under the first interceptor class it is an instance of only (an if/elif chain), so one
    object implementing all four would intercept unary-unary calls alone."""
    return [
        _UnaryUnary(interceptor),
        _UnaryStream(interceptor),
        _StreamUnary(interceptor),
        _StreamStream(interceptor),
    ]


def standard_client_interceptors(
    registry: CollectorRegistry, tracing: Tracing
) -> list[aio.ClientInterceptor]:
    """The interceptors of a service's channels to others; one list shared by all its channels
    (the metrics are registered once). Tracing off: no propagation interceptor."""
    chain = for_every_arity(ClientMetricsInterceptor(GrpcClientMetrics(registry)))
    if tracing.enabled:
        chain += for_every_arity(TraceContextClientInterceptor())
    return chain
