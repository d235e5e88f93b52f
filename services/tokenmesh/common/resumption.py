"""Resumed streams: what a stream has delivered to its caller, choice by choice, and the request
that continues it on another worker from exactly there (inference.proto's Resumption; the
worker appends each choice's delivered tokens to the prompt as ids and numbers on).

Whoever relays a stream keeps a Delivered and, when the worker serving it goes away before the
end, asks for `resumed(...)`: the same prepared request, plus what was delivered. A relay that
parses nothing (the edge's, in Envoy) appends the delivered messages' bytes to the request
instead (delivered_messages), which the worker reads with `read_delivered`."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from tokenmesh.common.channels import transport_reset
from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.tokens import ends_stream, token_count
from tokenmesh.v1 import inference_pb2, token_pb2

# Why a stream was resumed, as the metrics label it.
CAUSE_RESET = "stream_reset"  # the worker's stream or connection broke (killed, restarted)
CAUSE_UNAVAILABLE = "worker_unavailable"  # the worker answered UNAVAILABLE (its engine died)
CAUSE_ENGINE_DEAD = "engine_dead"  # the relaying worker's own engine died: it hands over


def resumable(err: aio.AioRpcError) -> str | None:
    """Why a worker's failed stream may continue elsewhere (a cause), or None: the worker went
    away or lost its engine. A deadline, a cancel, or an error in the request ends the
    stream as it is."""
    if transport_reset(err):
        return CAUSE_RESET
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        return CAUSE_UNAVAILABLE
    return None


def choice_count(request: inference_pb2.InferenceRequest) -> int:
    """The stream's choices: n for each prompt (of a batch)."""
    return max(request.sampling.n, 1) * max(len(request.prompts), 1)


class Delivered:
    """The tokens each choice of a stream has delivered, and which choices ended."""

    def __init__(self, choices: int) -> None:
        self._ids: list[list[int]] = [[] for _ in range(choices)]
        self._ended = [False] * choices
        self.tokens = 0
        # The stream's last message (every choice's usage) was delivered: nothing is missing.
        self.complete = False

    @classmethod
    def of(cls, request: inference_pb2.InferenceRequest) -> Delivered:
        """What the caller of `request` has had before it reached this worker: nothing, or
        for a resumed stream what its earlier workers delivered."""
        delivered = cls(choice_count(request))
        for choice in request.resume.choices:
            if 0 <= choice.choice < len(delivered._ids):
                delivered._ids[choice.choice].extend(choice.token_ids)
                delivered._ended[choice.choice] = choice.finished
                delivered.tokens += len(choice.token_ids)
        return delivered

    def add(self, token: token_pb2.Token) -> None:
        count = token_count(token)
        if count and 0 <= token.choice < len(self._ids):
            self._ids[token.choice].extend(token.token_ids or [token.token_id])
            self.tokens += count
        if token.finish_reason and 0 <= token.choice < len(self._ids):
            self._ended[token.choice] = True
        if ends_stream(token):
            self.complete = True

    def resumed(
        self, request: inference_pb2.InferenceRequest, attempt: int
    ) -> inference_pb2.InferenceRequest:
        """The request that continues the stream on another worker (attempt: 1 for the first
        move)."""
        again = inference_pb2.InferenceRequest()
        again.CopyFrom(request)
        again.resume.Clear()
        again.resume.attempt = attempt
        for choice, (ids, ended) in enumerate(zip(self._ids, self._ended, strict=True)):
            again.resume.choices.add(choice=choice, token_ids=ids, finished=ended)
        return again


def read_delivered(
    request: inference_pb2.InferenceRequest, parts: bool = False
) -> inference_pb2.InferenceRequest:
    """`request` with its delivered_messages (what a byte-level relay delivered: Token
    messages, or with `parts` GenerateOpenAI's HttpBody parts, each with its Token) read into
    `resume`, as Delivered.resumed writes it (attempt: the relay's, else 1); a request without
    them as it is. InvalidArgument names a message that is not what it should be."""
    if not request.delivered_messages:
        return request
    delivered = Delivered(choice_count(request))
    for i, message in enumerate(request.delivered_messages):
        delivered.add(delivered_token(message, parts, f"delivered_messages[{i}]"))
    bare = inference_pb2.InferenceRequest()
    bare.CopyFrom(request)
    del bare.delivered_messages[:]
    return delivered.resumed(bare, request.resume.attempt or 1)


def delivered_token(message: bytes, part: bool, field: str) -> token_pb2.Token:
    """The Token a delivered message holds: itself, or a relayed part's (RelayedPart)."""
    token = token_pb2.Token()
    relayed = inference_pb2.RelayedPart()
    try:
        if not part:
            token.ParseFromString(message)
            return token
        relayed.ParseFromString(message)
    except DecodeError as error:
        kind = "tokenmesh.v1.RelayedPart" if part else "tokenmesh.v1.Token"
        raise InvalidArgument(field, f"not a {kind} message: {error}") from error
    if not relayed.HasField("token"):
        raise InvalidArgument(field, "an HttpBody part without its tokenmesh.v1.Token")
    token.CopyFrom(relayed.token)
    return token
