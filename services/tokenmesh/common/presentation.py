"""What a caller sees of a prepared call, written once for whichever process presents it: the
worker, when Envoy streams its answer straight to the caller, or a gateway, when the tokens
pass through it. Both start from the same InferenceRequest (the gateway's preparation) and the
same Token messages."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from tokenmesh.common.openai_answers import (
    EventStream,
    Shape,
    WholeAnswer,
    error_response,
)
from tokenmesh.common.tokens import DEGRADED_HEADER, RESUMED_TRAILER
from tokenmesh.v1 import inference_pb2, token_pb2

EVENT_STREAM = "text/event-stream"
JSON = "application/json"


def degraded_marker(request: inference_pb2.InferenceRequest) -> tuple[tuple[str, str], ...]:
    """The marker of an answer made without a dependency: a gRPC trailer, an HTTP header."""
    return ((DEGRADED_HEADER, request.degraded),) if request.degraded else ()


def stream_trailers(
    request: inference_pb2.InferenceRequest, resumed: int = 0
) -> tuple[tuple[str, str], ...]:
    """A gRPC token stream's trailers: the degraded marker, and how many times the stream moved
    to another worker (resumed: as its tokens said, or as the request continuing it says)."""
    resumed = max(resumed, request.resume.attempt)
    moved = ((RESUMED_TRAILER, str(resumed)),) if resumed else ()
    return degraded_marker(request) + moved


def answer_extra(request: inference_pb2.InferenceRequest) -> dict[str, Any]:
    """The top-level field every OpenAI object and chunk of a degraded (or moved) answer
    carries."""
    if not request.degraded and not request.warnings and not request.resume.attempt:
        return {}
    extra: dict[str, Any] = {
        "degraded": request.degraded or None,
        "warnings": list(request.warnings),
    }
    if request.resume.attempt:
        # A worker continuing a moved stream presents what follows as moved.
        extra["resumed"] = request.resume.attempt
    return {"tokenmesh": extra}


class OpenAIPresenter:
    """One OpenAI answer (request.openai says which: a completion or a chat completion,
    streamed or whole) made from the stream's Token messages: its HTTP headers and its body,
    part by part. OpenAI's streaming rule lives here: an error before the first part is
    raised, for the caller's transport to answer with its HTTP status (error_response);
    after it, the error goes in the stream as an event, as OpenAI's servers send it, and is
    then raised, so the call or request still ends with its status."""

    def __init__(self, request: inference_pb2.InferenceRequest) -> None:
        answer = request.openai
        self.stream = answer.stream
        self.content_type = EVENT_STREAM if answer.stream else JSON
        self._shape = Shape.of(answer, answer_extra(request))
        self._logprobs = request.sampling.logprobs
        self._include_usage = answer.include_usage
        self._choices = max(request.sampling.n, 1)
        self._marker = degraded_marker(request)
        # It continues a stream its caller already has the start of (a relay moved it here).
        self._continues = request.HasField("resume")
        # The HTTP status and message of an error sent in a begun stream (for the transport's
        # accounting: the error is raised after its event).
        self.failure: tuple[int, str] | None = None

    def headers(self) -> tuple[tuple[str, str], ...]:
        """The answer's HTTP headers beside its content type, sent before its first part."""
        if self.stream:
            return (("cache-control", "no-cache"), *self._marker)
        return self._marker

    async def parts(self, tokens: AsyncIterator[token_pb2.Token]) -> AsyncGenerator[bytes, None]:
        """The body: each Token message's Server-Sent Events as it arrives (the first with a
        chat's role before it; [DONE] last), or the whole JSON object once the tokens end."""
        if not self.stream:
            whole = WholeAnswer(self._shape, self._logprobs)
            async for token in tokens:
                whole.add(token)
            yield json.dumps(whole.body(), separators=(",", ":")).encode()
            return
        events = EventStream(self._shape, self._logprobs, self._include_usage, self._choices)
        started, ended = self._continues, False
        try:
            async for token in tokens:
                data = events.token(token)
                if not started:
                    started = True
                    data = events.start() + data
                ended = events.ended
                yield data
        except Exception as exc:
            if not started:
                raise
            status, body, _ = error_response(exc)
            self.failure = (status, body["error"]["message"])
            yield events.failed(body)
            raise
        if not ended:
            # Tokens that stopped without a last one (none at all, even): the stream still
            # ends as OpenAI's do.
            yield (b"" if started else events.start()) + events.done()
