"""A worker whose engine died hands its streams over: what it sends the next worker, and when it
does not move a stream (the relay loop itself: test_resumption.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.unit.test_resumption import FakeCall, FakeStub, message
from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import Unavailable
from tokenmesh.common.outcome import Deadline
from tokenmesh.common.relay import Relay
from tokenmesh.common.resumption import Delivered
from tokenmesh.v1 import inference_pb2, token_pb2
from tokenmesh.worker.handover import Handover

DEAD = Unavailable("inference engine is down")
# The other workers, as a handing-over worker reaches them (never connected here).
WORKERS = Dependency("worker", "127.0.0.1:1", 1 << 20)


class Context:
    """What the handover reads of the caller's RPC: its metadata."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-tenant-id", "acme"), ("authorization", "Bearer secret"))


def request(max_tokens: int = 6) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=max_tokens)
    )


def hand_over(
    stub: FakeStub, sent: inference_pb2.InferenceRequest, delivered: Delivered, limit: int = 2
) -> list[token_pb2.Token]:
    handover = Handover(Relay(stub, limit, WORKERS.error))  # type: ignore[arg-type]
    assert handover.takes(delivered)

    async def read() -> list[token_pb2.Token]:
        stream = handover.stream(
            sent,
            delivered,
            Deadline(30.0),
            Context(),
            DEAD,
            0.0,  # type: ignore[arg-type]
        )
        return [token async for token in stream]

    return asyncio.run(read())


def rest(index: int, ids: list[int]) -> token_pb2.Token:
    last = message(0, index, ids, token_pb2.FINISH_REASON_LENGTH)
    last.usage.completion_tokens = 6
    return last


def test_a_stream_continues_after_what_it_delivered_one_move_more() -> None:
    # This worker itself continued a stream moved once: 2 tokens from the first worker, 2 here.
    sent = request()
    sent.resume.attempt = 1
    sent.resume.choices.add(choice=0, token_ids=[1, 2])
    delivered = Delivered.of(sent)
    delivered.add(message(0, 2, [3, 4]))
    stub = FakeStub(FakeCall([rest(4, [5, 6])], None))
    got = hand_over(stub, sent, delivered)
    assert [list(t.token_ids) for t in got] == [[5, 6]]
    [again] = stub.requests
    assert again.resume.attempt == 2
    assert [(c.choice, list(c.token_ids)) for c in again.resume.choices] == [(0, [1, 2, 3, 4])]
    assert again.prompt == "p" and again.sampling.max_tokens == 6
    assert delivered.complete


def test_a_stream_that_delivered_nothing_is_forwarded_as_it_came() -> None:
    sent = request()
    stub = FakeStub(FakeCall([rest(0, [1, 2, 3, 4, 5, 6])], None))
    hand_over(stub, sent, Delivered.of(sent))
    [forwarded] = stub.requests
    assert forwarded == sent and not forwarded.HasField("resume")


def test_a_stream_at_its_limit_ends_with_the_engines_error() -> None:
    sent = request()
    sent.resume.attempt = 2
    sent.resume.choices.add(choice=0, token_ids=[1])
    stub = FakeStub()
    with pytest.raises(Unavailable):
        hand_over(stub, sent, Delivered.of(sent), limit=2)
    assert stub.requests == []


def test_without_a_worker_to_move_to_or_once_complete_nothing_moves() -> None:
    assert not Handover(None).takes(Delivered(1))
    assert not Handover(Relay(FakeStub(), 0, WORKERS.error)).takes(Delivered(1))  # type: ignore[arg-type]
    done = Delivered(1)
    done.add(rest(0, [1]))
    assert not Handover(Relay(FakeStub(), 2, WORKERS.error)).takes(done)  # type: ignore[arg-type]


def test_the_next_worker_refusing_ends_the_stream_unavailable_naming_why() -> None:
    sent = request()
    delivered = Delivered.of(sent)
    delivered.add(message(0, 0, [1]))
    refusal = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "resume: a stream with stop strings cannot continue",
    )
    stub = FakeStub(FakeCall([], refusal))
    with pytest.raises(Exception) as ended:
        hand_over(stub, sent, delivered)
    assert getattr(ended.value, "code", None) == grpc.StatusCode.UNAVAILABLE
    assert "stop strings" in str(ended.value)


def test_the_worker_stops_only_once_its_streams_ended() -> None:
    async def run() -> tuple[bool, bool]:
        handover = Handover(None)
        with handover.open_stream():
            early = await handover.streams_ended(0.05)
        return early, await handover.streams_ended(0.05)

    assert asyncio.run(run()) == (False, True)
