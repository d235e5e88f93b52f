"""What a relayed stream delivered, and the request that continues it on another worker."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.api import httpbody_pb2
from grpc import aio

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import DependencyError, InvalidArgument
from tokenmesh.common.outcome import Deadline
from tokenmesh.common.relay import Relay
from tokenmesh.common.resumption import (
    CAUSE_RESET,
    CAUSE_UNAVAILABLE,
    Delivered,
    choice_count,
    read_delivered,
    resumable,
)
from tokenmesh.v1 import inference_pb2, token_pb2


def message(choice: int, index: int, ids: list[int], finish: int = 0) -> token_pb2.Token:
    return token_pb2.Token(
        choice=choice,
        index=index,
        token_id=ids[0] if ids else -1,
        token_ids=ids,
        finish_reason=finish,  # type: ignore[arg-type]
    )


def test_each_choice_keeps_its_own_tokens_and_end() -> None:
    original = inference_pb2.InferenceRequest(
        prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=9, n=3), warnings=["w"]
    )
    delivered = Delivered(choice_count(original))
    for token in (
        message(0, 0, [11]),
        message(1, 0, [21, 22]),
        message(0, 1, [12, 13]),
        message(1, 2, [23], token_pb2.FINISH_REASON_STOP),
        message(2, 0, [], token_pb2.FINISH_REASON_UNSPECIFIED),
    ):
        delivered.add(token)
    assert delivered.tokens == 6 and not delivered.complete
    again = delivered.resumed(original, 2)
    assert again.prompt == "p" and list(again.warnings) == ["w"]
    assert again.sampling.max_tokens == 9  # the worker subtracts what was delivered
    assert again.resume.attempt == 2
    assert [(c.choice, list(c.token_ids), c.finished) for c in again.resume.choices] == [
        (0, [11, 12, 13], False),
        (1, [21, 22, 23], True),
        (2, [], False),
    ]
    # The original is left as it was; a second move replaces the first's record.
    assert not original.HasField("resume")
    delivered.add(message(0, 3, [14]))
    assert next(list(c.token_ids) for c in delivered.resumed(again, 3).resume.choices) == [
        11,
        12,
        13,
        14,
    ]


def appended(field: int, payload: bytes) -> bytes:
    """A length-delimited field's bytes (tag, varint length, payload): what a relay that
    parses nothing appends to a serialized request."""
    encoded = bytearray([field << 3 | 2])
    length = len(payload)
    while length >= 0x80:
        encoded.append(length & 0x7F | 0x80)
        length >>= 7
    encoded.append(length)
    return bytes(encoded) + payload


def test_delivered_messages_appended_as_bytes_read_as_the_resume_a_relay_writes() -> None:
    """A byte-level relay keeps the worker's Token messages as they came and appends each to
    the request's bytes as delivered_messages (field 12), and its count of moves as
    resume.attempt (field 11's field 2): the worker reads the same request a Python relay's
    Delivered.resumed makes."""
    original = inference_pb2.InferenceRequest(
        prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=300, n=2), warnings=["w"]
    )
    sent = [
        message(0, 0, [11]),
        message(1, 0, list(range(100, 240))),  # a long message: a two-byte length
        message(0, 1, [12, 13], token_pb2.FINISH_REASON_STOP),
    ]
    relayed = original.SerializeToString() + b"".join(
        appended(12, token.SerializeToString()) for token in sent
    )
    relayed += appended(11, bytes([2 << 3, 2]))  # resume { attempt: 2 }
    received = inference_pb2.InferenceRequest.FromString(relayed)
    expected = Delivered(choice_count(original))
    for token in sent:
        expected.add(token)
    assert read_delivered(received) == expected.resumed(original, 2)
    # Without the relay's count it is the first move.
    first = inference_pb2.InferenceRequest.FromString(relayed[: -len(appended(11, b"xx"))])
    assert read_delivered(first).resume.attempt == 1
    assert not read_delivered(first).delivered_messages
    # A request without them is left as it is.
    assert read_delivered(original) is original


def test_a_delivered_message_that_is_not_a_token_is_refused_naming_it() -> None:
    received = inference_pb2.InferenceRequest(
        prompt="p", delivered_messages=[message(0, 0, [1]).SerializeToString(), b"\xff\xff"]
    )
    with pytest.raises(InvalidArgument) as refused:
        read_delivered(received)
    assert refused.value.field == "delivered_messages[1]"


def test_relayed_openai_parts_read_as_the_tokens_they_carry() -> None:
    """GenerateOpenAI's parts of a relayed answer each carry their Token (RelayedPart): handed
    back, they read as those Tokens would; a part without one is refused, naming it."""
    original = inference_pb2.InferenceRequest(
        prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=9)
    )
    sent = [message(0, 0, [5]), message(0, 1, [6, 7])]
    parts = []
    for token in sent:
        part = inference_pb2.RelayedPart(
            content_type="text/event-stream", data=b"data: {}\n\n", token=token
        )
        parts.append(part.SerializeToString())
    received = inference_pb2.InferenceRequest()
    received.CopyFrom(original)
    received.delivered_messages.extend(parts)
    expected = Delivered(1)
    for token in sent:
        expected.add(token)
    assert read_delivered(received, parts=True) == expected.resumed(original, 1)
    received.delivered_messages.append(httpbody_pb2.HttpBody(data=b"x").SerializeToString())
    with pytest.raises(InvalidArgument) as refused:
        read_delivered(received, parts=True)
    assert refused.value.field == "delivered_messages[2]"


def test_a_batch_has_n_choices_for_each_prompt() -> None:
    batch = inference_pb2.InferenceRequest(
        prompts=[inference_pb2.PromptInput(text="a"), inference_pb2.PromptInput(text="b")],
        sampling=inference_pb2.SamplingParams(max_tokens=3, n=2),
    )
    assert choice_count(batch) == 4
    assert choice_count(inference_pb2.InferenceRequest(prompt="x")) == 1


class Failed(aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, aio.Metadata(), aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "details", "cause"),
    [
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2", CAUSE_RESET),
        (grpc.StatusCode.UNKNOWN, "Stream removed", CAUSE_RESET),
        (grpc.StatusCode.UNAVAILABLE, "inference engine is down", CAUSE_UNAVAILABLE),
        (grpc.StatusCode.UNAVAILABLE, "upstream connect error", CAUSE_UNAVAILABLE),
        (grpc.StatusCode.INTERNAL, "inference engine failed the request", None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", None),
        (grpc.StatusCode.CANCELLED, "cancelled", None),
        (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too many", None),
    ],
)
def test_only_a_worker_gone_away_resumes(
    code: grpc.StatusCode, details: str, cause: str | None
) -> None:
    assert resumable(Failed(code, details)) == cause


def test_the_stream_is_complete_once_its_last_message_is_delivered() -> None:
    delivered = Delivered(1)
    delivered.add(message(0, 0, [1, 2]))
    assert not delivered.complete
    last = message(0, 2, [3], token_pb2.FINISH_REASON_LENGTH)
    last.usage.completion_tokens = 3
    delivered.add(last)
    assert delivered.complete and delivered.tokens == 3


class FakeCall:
    """A worker's Generate call: these tokens, then (optionally) this failure."""

    def __init__(self, tokens: list[token_pb2.Token], fail: aio.AioRpcError | None) -> None:
        self._tokens, self._fail = tokens, fail
        self.cancelled = False

    def __aiter__(self) -> FakeCall:
        self._left = iter(self._tokens)
        return self

    async def __anext__(self) -> token_pb2.Token:
        await asyncio.sleep(0)
        token = next(self._left, None)
        if token is not None:
            return token
        if self._fail is not None:
            raise self._fail
        raise StopAsyncIteration

    def done(self) -> bool:
        return True

    def cancel(self) -> None:
        self.cancelled = True

    async def initial_metadata(self) -> aio.Metadata:
        return aio.Metadata()


class FakeStub:
    """The worker's stub: one call per attempt, and the requests each attempt sent."""

    def __init__(self, *calls: FakeCall) -> None:
        self._calls = list(calls)
        self.requests: list[inference_pb2.InferenceRequest] = []

    def Generate(self, request: inference_pb2.InferenceRequest, **_: object) -> FakeCall:
        self.requests.append(request)
        return self._calls.pop(0)


def relay(stub: FakeStub, max_resumptions: int = 2) -> Relay:
    """The relay loop the gateway's worker client (and a worker handing over) runs, with the
    gateway's error mapping."""
    worker = Dependency("worker", "127.0.0.1:1", 1 << 20)
    return Relay(stub, max_resumptions, worker.error)  # type: ignore[arg-type]


RESET = Failed(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2")


def run(stub: FakeStub, max_resumptions: int = 2, seconds: float = 30.0) -> list[token_pb2.Token]:
    async def read() -> list[token_pb2.Token]:
        request = inference_pb2.InferenceRequest(
            prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=5)
        )
        stream = relay(stub, max_resumptions).stream(request, Deadline(seconds), Delivered(1))
        return [t async for t in stream]

    return asyncio.run(read())


def test_a_stream_whose_worker_goes_away_continues_where_it_stopped() -> None:
    last = message(0, 3, [4, 5], token_pb2.FINISH_REASON_LENGTH)
    last.usage.completion_tokens = 5
    stub = FakeStub(
        FakeCall([message(0, 0, [1]), message(0, 1, [2])], RESET),
        FakeCall([message(0, 2, [3])], Failed(grpc.StatusCode.UNAVAILABLE, "engine is down")),
        FakeCall([last], None),
    )
    got = run(stub)
    assert [t.index for t in got] == [0, 1, 2, 3] and got[-1].usage.completion_tokens == 5
    first, second, third = stub.requests
    assert not first.HasField("resume")
    assert [list(c.token_ids) for c in second.resume.choices] == [[1, 2]]
    assert second.resume.attempt == 1
    assert [list(c.token_ids) for c in third.resume.choices] == [[1, 2, 3]]
    assert third.resume.attempt == 2


def test_past_the_limit_or_before_a_token_the_workers_error_ends_the_stream() -> None:
    stub = FakeStub(FakeCall([message(0, 0, [1])], RESET), FakeCall([message(0, 1, [2])], RESET))
    with pytest.raises(DependencyError) as ended:
        run(stub, max_resumptions=1)
    assert ended.value.code == grpc.StatusCode.UNAVAILABLE and "after 2 tokens" in str(ended.value)
    assert len(stub.requests) == 2
    # Before any token Envoy has retried already: not moved.
    early = FakeStub(FakeCall([], RESET))
    with pytest.raises(DependencyError):
        run(early)
    assert len(early.requests) == 1
    # A failure of the request itself is not moved either.
    wrong = FakeStub(FakeCall([message(0, 0, [1])], Failed(grpc.StatusCode.INTERNAL, "boom")))
    with pytest.raises(DependencyError):
        run(wrong)
    assert len(wrong.requests) == 1


def test_a_stream_whose_worker_goes_away_past_its_deadline_ends_deadline_exceeded() -> None:
    stub = FakeStub(FakeCall([message(0, 0, [1])], RESET), FakeCall([message(0, 1, [2])], None))
    with pytest.raises(DependencyError) as ended:
        run(stub, seconds=0.0)
    assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline exceeded after 1 tokens" in str(ended.value)
    assert len(stub.requests) == 1


def test_a_continuation_the_next_worker_refuses_ends_the_stream_naming_why() -> None:
    refused = Failed(grpc.StatusCode.INVALID_ARGUMENT, "resume: a stream with stop strings ...")
    stub = FakeStub(FakeCall([message(0, 0, [1])], RESET), FakeCall([], refused))
    with pytest.raises(DependencyError) as ended:
        run(stub)
    assert ended.value.code == grpc.StatusCode.UNAVAILABLE
    assert "cannot continue on another worker: resume: a stream with stop strings" in str(
        ended.value
    )
