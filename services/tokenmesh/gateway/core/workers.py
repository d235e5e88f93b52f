"""Calls to the workers: a token stream read ahead of its caller, merged while the caller is
busy, cancelled (and the engine request aborted) when the caller goes away."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator

from grpc import aio
from opentelemetry import trace

from tokenmesh.common.channels import Dependency
from tokenmesh.common.outcome import Deadline
from tokenmesh.common.relay import Relay, ResumptionMetrics
from tokenmesh.common.resumption import Delivered, choice_count
from tokenmesh.common.tokens import UPSTREAM_HEADER, ends_stream, merge, token_count
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

log = logging.getLogger(__name__)


class ReadAhead:
    """Reads a worker call's messages while the gateway is still writing the last one to its
    caller, and merges those that arrive meanwhile (`next` takes them): each token goes on the
    moment it can, alone while the caller keeps up, and no timer holds any back. A merged
    message holds at most `per_message` tokens (one worker message is never split), and past
    `limit` tokens waiting it stops reading, so a stalled caller holds the worker back through
    HTTP/2 flow control instead of the gateway buffering its stream."""

    def __init__(self, call: AsyncIterator[token_pb2.Token], limit: int, per_message: int) -> None:
        self._limit = limit
        self._per_message = per_message
        self._waiting: deque[token_pb2.Token] = deque()
        self._waiting_tokens = 0
        self._error: Exception | None = None
        self._ended = False
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._reader = asyncio.create_task(self._read(call))

    async def _read(self, call: AsyncIterator[token_pb2.Token]) -> None:
        try:
            async for token in call:
                count = token_count(token)
                into = self._merges_into(token, count)
                if into is not None:
                    merge(into, token)
                else:
                    self._waiting.append(token)
                self._waiting_tokens += count
                self._arrived.set()
                if self._waiting_tokens >= self._limit:
                    self._room.clear()
                    await self._room.wait()
        except Exception as error:  # the call's failure is the stream's, raised by next()
            self._error = error
        finally:
            self._ended = True
            self._arrived.set()

    def _merges_into(self, token: token_pb2.Token, count: int) -> token_pb2.Token | None:
        """The waiting message `token` joins: the newest one of its choice, unless that one is
        full or ended. Choices interleave (n > 1), so that is not always the newest message;
        each choice keeps its own order. The stream's last message (it carries the usage of
        every choice) joins only the newest message, so that it stays last."""
        for waiting in reversed(self._waiting):
            if waiting.choice == token.choice:
                if waiting.finish_reason or token_count(waiting) + count > self._per_message:
                    return None
                return waiting
            if ends_stream(token):
                return None
        return None

    async def next(self) -> token_pb2.Token | None:
        """What arrived since the last call (merged, up to per_message tokens); None at the
        end."""
        while not self._waiting:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._arrived.clear()
            await self._arrived.wait()
        token = self._waiting.popleft()
        self._waiting_tokens -= token_count(token)
        self._room.set()
        return token

    def close(self) -> None:
        self._reader.cancel()


async def record_upstream(call: aio.UnaryStreamCall) -> None:
    """The worker Envoy chose for the call (its answer's x-tokenmesh-upstream), on the current
    span: with the affinity key, the routing decision."""
    for name, value in await call.initial_metadata() or ():
        if name == UPSTREAM_HEADER:
            trace.get_current_span().set_attribute("tokenmesh.worker", str(value))


class WorkerClient:
    """Streams tokens from a worker; cancelling the stream cancels the worker call, which
    aborts the engine request. A stream whose worker goes away after its first token continues
    on another worker from the token where it stopped (common/resumption.py), at most
    max_resumptions times and within the time limit."""

    def __init__(
        self,
        worker: Dependency,
        connect_timeout: float,
        max_coalesced: int = 256,
        max_message_tokens: int = 64,
        max_resumptions: int = 0,
        metrics: ResumptionMetrics | None = None,
    ) -> None:
        self._worker = worker
        self._connect_timeout = connect_timeout
        self._relay = Relay(
            inference_pb2_grpc.InferenceServiceStub(worker.channel),
            max_resumptions,
            worker.error,
            metrics,
            reader=lambda call: ReadAhead(call, max_coalesced, max_message_tokens),
            answered=record_upstream,
        )

    def stream(
        self,
        request: inference_pb2.InferenceRequest,
        time_limit: float | None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> AsyncGenerator[token_pb2.Token, None]:
        """The relay's own stream (no generator of its own around it: each token passes one
        fewer frame), once the worker's channel is connected."""
        connect_within = self._connect_timeout
        if time_limit is not None:
            connect_within = min(connect_within, time_limit)
        # A call that fails (all but) at its deadline failed because of it: Envoy enforces the
        # same deadline (grpc-timeout) and resets the stream when it passes.
        deadline = Deadline(time_limit)
        delivered = Delivered(choice_count(request))
        ready = functools.partial(self._worker.ensure_connected, connect_within)
        return self._relay.stream(request, deadline, delivered, 0, metadata, ready=ready)
