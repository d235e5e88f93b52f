"""A whole answer on the gateway token path (GetAnswer, Summarize) says what its stream's
trailers say: degraded, and moved to another worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tokenmesh.gateway.core.prepare import PreparedCall
from tokenmesh.gateway.frontends.grpc import collect, marked
from tokenmesh.v1 import inference_pb2, token_pb2


class Context:
    """What marking reads and writes of an RPC: its trailers."""

    def __init__(self) -> None:
        self.trailers: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, trailers: tuple[tuple[str, str], ...]) -> None:
        self.trailers = trailers


async def stream(*tokens: token_pb2.Token) -> AsyncIterator[token_pb2.Token]:
    for token in tokens:
        yield token


def test_a_moved_answer_says_so_in_its_trailers_beside_the_degraded_marker() -> None:
    call = PreparedCall(inference_pb2.InferenceRequest(prompt="p", degraded="reranker"), "k")
    context = Context()
    last = token_pb2.Token(
        index=2, text="c", token_id=3, finish_reason=token_pb2.FINISH_REASON_LENGTH
    )
    last.usage.completion_tokens = 3
    tokens = stream(
        token_pb2.Token(index=0, text="a", token_id=1),
        token_pb2.Token(index=1, text="b", token_id=2, resumed=1),
        last,
    )
    answer = asyncio.run(collect(marked(context, call, tokens)))  # type: ignore[arg-type]
    assert answer.text == "abc" and answer.usage.completion_tokens == 3
    assert dict(context.trailers) == {
        "x-tokenmesh-degraded": "reranker",
        "x-tokenmesh-resumed": "1",
    }


def test_an_answer_that_never_moved_has_no_resumed_trailer() -> None:
    call = PreparedCall(inference_pb2.InferenceRequest(prompt="p"), "k")
    context = Context()
    asyncio.run(collect(marked(context, call, stream(token_pb2.Token(text="a")))))  # type: ignore[arg-type]
    assert context.trailers == ()
