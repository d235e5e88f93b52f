"""The OpenAI API's HTTP transport: uvicorn on the gateway's event loop, an answer that ends
when its client goes away, and the request metrics (no rules of OpenAI's: those are in
common/presentation.py and the routes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenmesh.common.credentials import ReloadingSslContext
from tokenmesh.common.metrics import RPC_BUCKETS
from tokenmesh.common.openai_answers import error_response


class HttpMetrics:
    """OpenAI API requests: those this gateway answered, and those it prepared for Envoy to
    take straight from a worker (recorded from Envoy's access log,
    gateway/frontends/direct_log.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "tokenmesh_gateway_http_requests_total",
            "OpenAI API requests by route, HTTP status (499: the client went away) and the path "
            "their tokens took (gateway: through this gateway; direct: from a worker through "
            "Envoy, as Envoy logged it).",
            ["route", "status", "path"],
            registry=registry,
        )
        self.duration = Histogram(
            "tokenmesh_gateway_http_request_duration_seconds",
            "OpenAI API requests, from the request to the end of the answer, by route and path.",
            ["route", "path"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )

    def record(self, route: str, status: int, path: str, seconds: float) -> None:
        """One request: its route, the HTTP status its caller got, the path its tokens
        took."""
        self.requests.labels(route, str(status), path).inc()
        self.duration.labels(route, path).observe(seconds)


@dataclass
class Outcome:
    """What became of one request, for its log line, metrics and span."""

    status: int = 200
    error: str | None = None


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Answer(Response):
    """The answer to one request, written by `work` (which sends the response itself). A
    client that goes away at any point, before the first token or in the middle of the
    stream, cancels `work`, and with it the worker call, which aborts the engine request."""

    def __init__(self, work: Callable[[Send], Awaitable[None]], outcome: Outcome) -> None:
        self._work = work
        self._outcome = outcome

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._work(send))
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Whether the answer was all sent: once it is, the server reports a disconnect
            # at once, which must not count as the client going away.
            answered = work.done()
            for task in (work, gone):
                task.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
        if not answered:
            self._outcome.status = 499
            self._outcome.error = "client disconnected"
        elif not work.cancelled() and work.exception() is not None:
            raise work.exception()  # type: ignore[misc]


async def send_error(send: Send, outcome: Outcome, exc: Exception) -> None:
    """An error as OpenAI's error object with its status and headers, noted in the outcome."""
    status, body, headers = error_response(exc)
    outcome.status, outcome.error = status, body["error"]["message"]
    await send_json(send, status, body, headers)


async def send_json(
    send: Send,
    status: int,
    body: Any,
    headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
    encoded: bool = False,
) -> None:
    """A whole JSON response: body as an object, or its bytes already (encoded)."""
    data = body if encoded else json.dumps(body, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def send_chunk(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


def request_headers(request: Request) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]


class Finishing(Response):
    """A response that calls `done` once it has been sent (or its sending failed)."""

    def __init__(self, inner: Response, done: Callable[[], None]) -> None:
        self._inner = inner
        self._done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._inner(scope, receive, send)
        finally:
            self._done()


class HostedServer(uvicorn.Server):
    """uvicorn inside the service host: the host owns the signals and the shutdown."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


@dataclass
class HttpServer:
    """uvicorn serving the OpenAI API on the gateway's event loop. Starlette (routing, request
    bodies) on uvicorn with httptools is what vLLM's own OpenAI server stands on, kept up by
    the same people as the ASGI spec; neither touches a streamed token: each chunk is written
    by Answer straight to the ASGI send, whose wait for the transport (uvicorn's flow control)
    holds the worker's stream back when a client reads slowly. With the TLS files (the
    gateway's tls_* settings, as on its gRPC port) it speaks only TLS and refuses clients
    without a certificate signed by tls_client_ca_file (Envoy's, mTLS)."""

    app: Starlette
    host: str
    port: int
    grace_seconds: float
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    # How often the TLS files are looked at (a stat each) for a renewed certificate.
    tls_check_seconds: float = 5.0
    _server: uvicorn.Server | None = None
    _task: asyncio.Task[None] | None = None
    _tls_watch: asyncio.Task[None] | None = None

    async def start(self) -> int:
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            loop="none",
            http="httptools",
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=max(1, int(self.grace_seconds)),
            # Unset (the default): plaintext. The settings come all three or none.
            ssl_certfile=self.tls_cert_file,
            ssl_keyfile=self.tls_key_file,
            ssl_ca_certs=self.tls_client_ca_file,
            ssl_cert_reqs=ssl.CERT_NONE if self.tls_client_ca_file is None else ssl.CERT_REQUIRED,
        )
        self._server = HostedServer(config)
        self._task = asyncio.create_task(self._server.serve(), name="openai-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the OpenAI API server stopped before it started")
            await asyncio.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        if config.ssl is not None:
            assert self.tls_cert_file and self.tls_key_file and self.tls_client_ca_file
            context = ReloadingSslContext(
                config.ssl, self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file
            )
            self._tls_watch = asyncio.create_task(self._watch_tls(context), name="openai-tls")
        return int(sockets[0].getsockname()[1])

    async def _watch_tls(self, context: ReloadingSslContext) -> None:
        while True:
            await asyncio.sleep(self.tls_check_seconds)
            context.reload()

    async def stop(self) -> None:
        if self._tls_watch is not None:
            self._tls_watch.cancel()
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
