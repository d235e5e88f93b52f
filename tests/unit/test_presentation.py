"""What a caller sees of a prepared call, as the worker (direct path) and a gateway (its own
path) both present it: OpenAI's streaming rule, the degraded marker, the "tokenmesh" field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tokenmesh.common.errors import DeadlineExceeded, InvalidArgument
from tokenmesh.common.openai_answers import Shape
from tokenmesh.common.presentation import (
    OpenAIPresenter,
    answer_extra,
    degraded_marker,
    stream_trailers,
)
from tokenmesh.v1 import inference_pb2, token_pb2


def request(stream: bool = True, degraded: str = "", chat: bool = True) -> Any:
    answer = Shape.new_answer(chat, "tiny", stream, include_usage=False)
    prepared = inference_pb2.InferenceRequest(
        prompt="hi", openai=answer, degraded=degraded, sampling={"max_tokens": 4}
    )
    if degraded:
        prepared.warnings.append("reranker_unavailable: UNAVAILABLE")
    return prepared


async def tokens(*texts: str, fail: Exception | None = None) -> AsyncIterator[token_pb2.Token]:
    for index, text in enumerate(texts):
        last = index == len(texts) - 1 and fail is None
        token = token_pb2.Token(text=text, index=index, token_ids=[index])
        if last:
            token.finish_reason = token_pb2.FINISH_REASON_LENGTH
            token.usage.prompt_tokens, token.usage.completion_tokens = 3, len(texts)
        yield token
    if fail is not None:
        raise fail


def events(parts: list[bytes]) -> list[Any]:
    lines = b"".join(parts).decode().split("\n\n")
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line]


async def collect(presenter: OpenAIPresenter, stream: AsyncIterator[Any]) -> list[bytes]:
    return [part async for part in presenter.parts(stream)]


async def test_a_stream_is_one_part_per_token_message_role_first_and_done_last() -> None:
    presenter = OpenAIPresenter(request())
    parts = await collect(presenter, tokens("a", "b"))
    assert len(parts) == 2
    found = events(parts)
    assert found[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in found[1:3]] == ["a", "b"]
    assert found[2]["choices"][0]["finish_reason"] == "length"
    assert found[-1] == "[DONE]"
    assert presenter.content_type == "text/event-stream"
    assert presenter.headers() == (("cache-control", "no-cache"),)


async def test_an_error_before_the_first_part_is_raised_for_the_transports_status() -> None:
    presenter = OpenAIPresenter(request())
    with pytest.raises(InvalidArgument):
        await collect(presenter, tokens(fail=InvalidArgument("prompt", "too long")))
    assert presenter.failure is None


async def test_an_error_after_the_first_part_is_an_event_then_raised() -> None:
    presenter = OpenAIPresenter(request())
    parts: list[bytes] = []
    with pytest.raises(DeadlineExceeded):
        async for part in presenter.parts(tokens("a", fail=DeadlineExceeded("time limit"))):
            parts.append(part)
    found = events(parts)
    assert found[-2]["error"]["message"] == "time limit" and found[-1] == "[DONE]"
    assert presenter.failure == (504, "time limit")


async def test_tokens_that_stop_without_a_last_one_still_end_the_stream() -> None:
    found = events(await collect(OpenAIPresenter(request()), tokens()))
    assert found[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert found[1:] == ["[DONE]"]


async def test_a_whole_answer_is_one_json_object_with_usage() -> None:
    presenter = OpenAIPresenter(request(stream=False, chat=False))
    (part,) = await collect(presenter, tokens("a", "b"))
    body = json.loads(part)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "ab"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert presenter.content_type == "application/json" and presenter.headers() == ()


async def test_a_degraded_answer_says_so_in_its_headers_and_every_object() -> None:
    prepared = request(degraded="reranker")
    assert degraded_marker(prepared) == (("x-tokenmesh-degraded", "reranker"),)
    assert answer_extra(prepared) == {
        "tokenmesh": {"degraded": "reranker", "warnings": ["reranker_unavailable: UNAVAILABLE"]}
    }
    presenter = OpenAIPresenter(prepared)
    assert ("x-tokenmesh-degraded", "reranker") in presenter.headers()
    found = events(await collect(presenter, tokens("a")))
    assert all(e["tokenmesh"]["degraded"] == "reranker" for e in found if e != "[DONE]")
    assert degraded_marker(request()) == () and answer_extra(request()) == {}


async def moved(*texts: str, at: int) -> AsyncIterator[token_pb2.Token]:
    """tokens(), the message at index `at` the first from the worker the stream moved to."""
    async for token in tokens(*texts):
        if token.index == at:
            token.resumed = 1
        yield token


@pytest.mark.parametrize("chat", [True, False])
async def test_a_moved_stream_says_so_from_the_first_part_after_the_move(chat: bool) -> None:
    found = events(await collect(OpenAIPresenter(request(chat=chat)), moved("a", "b", "c", at=1)))
    chunks = [e for e in found if e != "[DONE]" and e["choices"]]
    texts = [
        e["choices"][0]["delta"].get("content") if chat else e["choices"][0]["text"] for e in chunks
    ]
    resumed = [e.get("tokenmesh", {}).get("resumed") for e in chunks]
    assert texts[-3:] == ["a", "b", "c"]
    assert resumed[-3:] == [None, 1, 1]
    # A whole answer, and one the new worker presents (its request says it continues).
    (part,) = await collect(OpenAIPresenter(request(stream=False)), moved("a", "b", at=1))
    assert json.loads(part)["tokenmesh"]["resumed"] == 1
    continuing = request()
    continuing.resume.attempt = 2
    assert answer_extra(continuing)["tokenmesh"]["resumed"] == 2


def test_a_moved_grpc_stream_has_its_trailer() -> None:
    continuing = request(degraded="reranker")
    assert stream_trailers(continuing) == (("x-tokenmesh-degraded", "reranker"),)
    assert stream_trailers(continuing, 1)[-1] == ("x-tokenmesh-resumed", "1")
    continuing.resume.attempt = 2
    assert stream_trailers(continuing)[-1] == ("x-tokenmesh-resumed", "2")
