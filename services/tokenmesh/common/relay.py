"""Relaying a token stream from the workers behind one channel (an Envoy listener that picks a
healthy worker for each call), moving it to another worker when the one serving it goes away
(common/resumption.py says what moves). The gateway relays its token path through it; a worker
whose engine died hands its streams over through it.

One loop, whoever relays: a stream moves only after it delivered something (before that, Envoy
retried it already, or the relay forwards the request as it is), at most `max_resumptions`
times in all, and only within its deadline; when the next worker refuses to continue it (what
it cannot carry over: stop strings, structured outputs), the stream ends UNAVAILABLE naming
why."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Protocol

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenmesh.common.errors import DependencyError
from tokenmesh.common.outcome import Deadline
from tokenmesh.common.resumption import (
    CAUSE_ENGINE_DEAD,
    CAUSE_RESET,
    CAUSE_UNAVAILABLE,
    Delivered,
    resumable,
)
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

log = logging.getLogger(__name__)

# Why a stream that could have moved did not (the refused counter's reasons).
REFUSALS = ("limit", "deadline", "request")


class Reader(Protocol):
    """How a relay reads one worker call: the next message (None at the end), and close."""

    async def next(self) -> token_pb2.Token | None: ...

    def close(self) -> None: ...


class PlainReader:
    """A worker call's messages one by one, as they come."""

    def __init__(self, call: AsyncIterator[token_pb2.Token]) -> None:
        self._messages = aiter(call)

    async def next(self) -> token_pb2.Token | None:
        return await anext(self._messages, None)

    def close(self) -> None:
        pass


class ResumptionMetrics:
    """Streams a relay moved to another worker, by cause, and the gap their callers saw
    (tokenmesh_<role>_resumptions_total and the rest)."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.resumed = Counter(
            f"tokenmesh_{role}_resumptions",
            "Streams that moved to another worker mid-stream, by why (stream_reset: the "
            "worker's stream or connection broke; worker_unavailable: it lost its engine; "
            "engine_dead: this worker's own engine died)",
            ["cause"],
            registry=registry,
        )
        self.refused = Counter(
            f"tokenmesh_{role}_resumptions_refused",
            "Streams whose worker went away mid-stream that could not move (limit: at "
            "max_resumptions already; deadline: none left; request: the worker refused the "
            "continuation, e.g. stop strings or structured outputs)",
            ["reason"],
            registry=registry,
        )
        self.gap_seconds = Histogram(
            f"tokenmesh_{role}_resumption_gap_seconds",
            "A resumed stream's gap: from the last token before its worker went away to the "
            "first from the next worker",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=registry,
        )
        # Every series from the start (at 0), so dashboards and alerts see a mesh where
        # nothing has moved yet as that, not as missing data.
        for cause in (CAUSE_RESET, CAUSE_UNAVAILABLE, CAUSE_ENGINE_DEAD):
            self.resumed.labels(cause=cause)
        for reason in REFUSALS:
            self.refused.labels(reason=reason)


class Relay:
    """Streams prepared requests from the workers behind `stub`'s channel. `fail` turns a
    call's failure into the caller's error (its Dependency's error); `reader` reads a call
    (the gateway reads ahead and merges); `answered` sees each call once its first message
    came."""

    def __init__(
        self,
        stub: inference_pb2_grpc.InferenceServiceStub,
        max_resumptions: int,
        fail: Callable[[aio.AioRpcError, str], Exception],
        metrics: ResumptionMetrics | None = None,
        reader: Callable[[aio.UnaryStreamCall], Reader] = PlainReader,
        answered: Callable[[aio.UnaryStreamCall], Awaitable[None]] | None = None,
    ) -> None:
        self._stub = stub
        self.max_resumptions = max_resumptions
        self._metrics = metrics
        self._fail = fail
        self._reader = reader
        self._answered = answered

    def move(
        self, cause: str, attempt: int, during: str, why: str, what: str = "worker went away"
    ) -> bool:
        """One move more (attempt: 1 for the stream's first), counted and logged; False, counted
        as refused, when the stream has moved as often as it may."""
        if attempt > self.max_resumptions:
            self.refused("limit")
            return False
        if self._metrics is not None:
            self._metrics.resumed.labels(cause=cause).inc()
        log.warning(
            "%s %s (%s); resuming the stream on another worker (resumption %d of at most %d)",
            what,
            during,
            why,
            attempt,
            self.max_resumptions,
        )
        return True

    def refused(self, reason: str) -> None:
        """A stream that could have moved did not, for this reason."""
        if self._metrics is not None and self.max_resumptions:
            self._metrics.refused.labels(reason=reason).inc()

    async def stream(
        self,
        request: inference_pb2.InferenceRequest,
        deadline: Deadline,
        delivered: Delivered,
        attempt: int = 0,
        metadata: tuple[tuple[str, str], ...] = (),
        last_token_at: float | None = None,
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[token_pb2.Token, None]:
        """The stream of `request` (as prepared, without `resume`) from the workers; `delivered`
        is what its caller has had (filled in as messages go), `attempt` the moves so far,
        `last_token_at` when its caller had the last token (a stream already moved), and
        `ready` what to wait for before the first call (the channel connected)."""
        if ready is not None:
            await ready()
        current = delivered.resumed(request, attempt) if attempt else request
        while True:
            call = self._stub.Generate(
                current, timeout=deadline.remaining(), metadata=metadata or None
            )
            reader = self._reader(call)
            first = True
            try:
                while (token := await reader.next()) is not None:
                    if first:
                        first = False
                        if self._answered is not None:
                            await self._answered(call)
                        if attempt and last_token_at is not None and self._metrics is not None:
                            self._metrics.gap_seconds.observe(time.monotonic() - last_token_at)
                    delivered.add(token)
                    last_token_at = time.monotonic()
                    yield token
                return
            except aio.AioRpcError as err:
                # Failed before its first token, it was retried by Envoy already; after, it
                # moves to another worker if it may, and otherwise the message says how far it
                # got.
                if delivered.complete:
                    # It broke after its last message: the caller has the whole answer.
                    return
                during = f"after {delivered.tokens} tokens" if delivered.tokens else ""
                cause = resumable(err) if delivered.tokens else None
                if deadline.passed():
                    if cause is not None:
                        self.refused("deadline")
                    raise DependencyError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"worker: deadline exceeded {during or 'before the first token'}",
                    ) from err
                if attempt and first and err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # The next worker refused to continue this stream (what it cannot carry
                    # over): the first worker's failure ends it, with the reason.
                    self.refused("request")
                    raise DependencyError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"worker: went away {during}, and the stream cannot continue on "
                        f"another worker: {err.details()}",
                    ) from err
                if cause is None or not self.move(
                    cause, attempt + 1, during, err.details() or err.code().name
                ):
                    raise self._fail(err, during) from err
                attempt += 1
                current = delivered.resumed(request, attempt)
            finally:
                reader.close()
                # The caller went away (or stopped reading) before the worker's end: cancel
                # the call, which aborts the engine request. A finished call is left as it is.
                if not call.done():
                    call.cancel()
