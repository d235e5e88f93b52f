"""A worker whose engine died hands its streams over: each continues on another worker from the
token where it stopped (common/relay.py, the gateway's own relay loop), while this worker's
front end, alive, relays the rest to its caller. On the direct token path nothing else knows
what a stream delivered; this is how a GPU fault that kills only the engine breaks no answer.
(A worker killed whole needs a relay in front of it: the gateway's token path.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from grpc import aio

from tokenmesh.common.outcome import Deadline
from tokenmesh.common.relay import Relay
from tokenmesh.common.resumption import CAUSE_ENGINE_DEAD, Delivered
from tokenmesh.v1 import inference_pb2, token_pb2

log = logging.getLogger(__name__)

# The caller's metadata a handed-over call carries on (the tenant, for the next worker's logs).
CARRIED_METADATA = ("x-tenant-id",)


class Handover:
    """Counts the worker's open streams (a worker whose engine died stops once they have all
    ended) and hands a stream over when the engine under it died."""

    def __init__(self, relay: Relay | None) -> None:
        self._relay = relay
        self._open = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def open_stream(self) -> Iterator[None]:
        self._open += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._open -= 1
            if not self._open:
                self._idle.set()

    async def streams_ended(self, within: float) -> bool:
        """Wait (at most `within` seconds) until no stream is open; False if some still are."""
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return False
        return True

    def takes(self, delivered: Delivered) -> bool:
        """Whether a stream whose engine died moves on (it has a worker to move to and has not
        moved as often as it may), or ends with the engine's error."""
        return (
            self._relay is not None and self._relay.max_resumptions > 0 and not delivered.complete
        )

    def stream(
        self,
        request: inference_pb2.InferenceRequest,
        delivered: Delivered,
        deadline: Deadline,
        context: aio.ServicerContext[Any, Any],
        error: Exception,
        last_sent_unix_nanos: int,
    ) -> AsyncGenerator[token_pb2.Token, None]:
        """The rest of `request`'s stream from another worker, within the caller's deadline. A
        stream that delivered nothing yet is forwarded as it came; one that did continues
        after what it delivered, one move more than the request had made (last_sent_unix_nanos:
        when its last message went out, for the gap). Raises `error` when the stream has moved
        as often as it may."""
        assert self._relay is not None
        attempt = 0
        if delivered.tokens:
            attempt = request.resume.attempt + 1
            during = f"after {delivered.tokens} tokens"
            if not self._relay.move(CAUSE_ENGINE_DEAD, attempt, during, str(error), "engine died"):
                raise error
        metadata = tuple(
            (key, str(value))
            for key, value in context.invocation_metadata() or ()
            if key in CARRIED_METADATA
        )
        # The relay's clock is the monotonic one: the last message's age, taken from now.
        last_token_at = time.monotonic() - (time.time_ns() - last_sent_unix_nanos) / 1e9
        return self._relay.stream(request, deadline, delivered, attempt, metadata, last_token_at)
