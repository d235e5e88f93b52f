"""Resumed streams on a real worker: a request that carries what another worker had delivered
(InferenceRequest.resume) continues each unfinished choice from that token, as the undisturbed
stream would have (greedy), numbered on, with usage counting the whole answer."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.api import httpbody_pb2

from tests.support import (
    generated,
    positions,
)
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

pytestmark = pytest.mark.integration


def request(max_tokens: int, n: int = 1, **fields: object) -> inference_pb2.InferenceRequest:
    made = inference_pb2.InferenceRequest(
        sampling=inference_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n
        ),
        **fields,  # type: ignore[arg-type]
    )
    if "prompt" not in fields and "messages" not in fields:
        made.prompt = "The history of the printing press"
    return made


def resumed(
    original: inference_pb2.InferenceRequest,
    delivered: dict[int, list[int]],
    finished: tuple[int, ...] = (),
) -> inference_pb2.InferenceRequest:
    again = inference_pb2.InferenceRequest()
    again.CopyFrom(original)
    again.resume.attempt = 1
    for choice, ids in sorted(delivered.items()):
        again.resume.choices.add(choice=choice, token_ids=ids, finished=choice in finished)
    return again


async def stream(
    stub: inference_pb2_grpc.InferenceServiceStub, made: inference_pb2.InferenceRequest
) -> list[token_pb2.Token]:
    return [token async for token in stub.Generate(made, timeout=120)]


def ids(tokens: list[token_pb2.Token]) -> list[int]:
    return [token.token_id for token in generated(tokens)]


async def test_a_resumed_stream_goes_on_as_the_undisturbed_one(
    inference: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    original = request(40)
    whole = await stream(inference, original)
    delivered = ids(whole)[:15]
    rest = await stream(inference, resumed(original, {0: delivered}))
    assert positions(rest) == list(range(15, 40))
    assert ids(rest) == ids(whole)[15:]
    assert rest[0].resumed == 1 and not any(t.resumed for t in rest[1:])
    assert rest[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
    # The prompt once, every token of the answer once.
    assert rest[-1].usage.prompt_tokens == whole[-1].usage.prompt_tokens
    assert rest[-1].usage.completion_tokens == 40


async def test_the_text_goes_on_exactly_wherever_the_stream_stopped(
    inference: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    """Cut after any message, the delivered text and the resumed text make the undisturbed
    text: also where a token began a character the next one completes (its message had no
    text yet; the tiny model writes many such)."""
    original = request(160, prompt="Ünïcödé: 日本語の文章と絵文字 🎉🎊 ")
    whole = await stream(inference, original)
    held = [i for i, t in enumerate(whole[:-1]) if t.token_ids and not t.text]
    cuts = sorted({*held[:4], 3, 40})
    for cut in cuts:
        delivered = whole[: cut + 1]
        rest = await stream(inference, resumed(original, {0: ids(delivered)}))
        assert ids(delivered) + ids(rest) == ids(whole), cut
        text = "".join(t.text for t in delivered) + "".join(t.text for t in rest)
        assert text == "".join(t.text for t in whole), cut
    assert held, "no message held a character back: the cut at one is untested"


async def test_a_resumed_conversation_goes_on_as_the_undisturbed_one(
    inference: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    original = request(
        24, messages=[inference_pb2.ConversationMessage(role="user", content="Name three rivers")]
    )
    whole = await stream(inference, original)
    rest = await stream(inference, resumed(original, {0: ids(whole)[:9]}))
    assert positions(rest) == list(range(9, 24))
    assert ids(rest) == ids(whole)[9:]
    assert rest[-1].usage.prompt_tokens == whole[-1].usage.prompt_tokens


async def test_each_choice_resumes_from_its_own_token_and_an_ended_one_stays_ended(
    inference: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    original = request(12, n=3)
    # Greedy, as top_k 1: vLLM refuses temperature 0 with several choices.
    original.sampling.temperature, original.sampling.top_k = 1.0, 1
    whole = await stream(inference, original)
    by_choice = {c: ids([t for t in whole if t.choice == c]) for c in range(3)}
    delivered = {0: by_choice[0][:4], 1: by_choice[1], 2: []}
    rest = await stream(inference, resumed(original, delivered, finished=(1,)))
    assert {t.choice for t in rest} == {0, 2}
    assert positions([t for t in rest if t.choice == 0]) == list(range(4, 12))
    assert positions([t for t in rest if t.choice == 2]) == list(range(12))
    # Greedy: every choice is the same answer, resumed or not.
    assert ids([t for t in rest if t.choice == 0]) == by_choice[0][4:]
    assert ids([t for t in rest if t.choice == 2]) == by_choice[2]
    ends = [t for t in rest if t.finish_reason]
    assert sorted(t.choice for t in ends) == [0, 2]
    assert [t.HasField("usage") for t in rest] == [False] * (len(rest) - 1) + [True]
    assert rest[-1].usage.completion_tokens == 36


async def test_a_choice_that_delivered_every_token_gets_its_end(
    inference: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    original = request(5)
    whole = await stream(inference, original)
    rest = await stream(inference, resumed(original, {0: ids(whole)}))
    assert len(rest) == 1 and positions(rest) == []
    assert rest[0].index == 5
    assert rest[0].finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert rest[0].usage.completion_tokens == 5


async def test_delivered_messages_as_a_byte_level_relay_sends_them_resume_the_stream(
    inference: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    """The edge's relay keeps the worker's messages as bytes and appends them to the request
    (delivered_messages): the stream goes on from there as with `resume`, numbered on, the
    whole answer in usage."""
    original = request(40)
    whole = await stream(inference, original)
    cut = 3  # messages delivered before the worker went away
    carried = inference_pb2.InferenceRequest()
    carried.CopyFrom(original)
    carried.delivered_messages.extend(token.SerializeToString() for token in whole[:cut])
    rest = await stream(inference, carried)
    assert ids(whole[:cut]) + ids(rest) == ids(whole)
    assert positions(whole[:cut]) + positions(rest) == list(range(40))
    assert rest[0].resumed == 1
    assert rest[-1].usage.completion_tokens == 40
    # GenerateOpenAI's delivered messages are its own HttpBody parts, not Token messages.
    carried.openai.chat = True
    carried.openai.stream = True
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        _ = [part async for part in inference.GenerateOpenAI(carried, timeout=60)]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("delivered_messages[0]"), refused.value.details()


def events(parts: list[httpbody_pb2.HttpBody]) -> list[Any]:
    """The Server-Sent Events' data of a streamed answer's parts: JSON chunks, then [DONE]."""
    text = b"".join(part.data for part in parts).decode()
    data = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def test_a_relayed_openai_stream_resumes_from_the_parts_it_delivered(
    inference: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    """A relayed answer's parts each carry their Token; handed back as delivered_messages,
    they let another worker continue the caller's begun stream: no second role chunk, the
    content goes on where it stopped, the chunks after the move say so, one finish, the whole
    answer's usage, one [DONE]."""
    original = request(40, messages=[inference_pb2.ConversationMessage(role="user", content="Hi")])
    original.openai.MergeFrom(
        inference_pb2.OpenAIAnswer(
            chat=True, id="chatcmpl-r", created=1, model="m", stream=True, include_usage=True
        )
    )
    original.openai.relayed = True
    whole = [part async for part in inference.GenerateOpenAI(original, timeout=120)]
    # Each part carries its Token in a field HttpBody does not have (the transcoder skips it).
    assert all(
        inference_pb2.RelayedPart.FromString(part.SerializeToString()).HasField("token")
        for part in whole
    )
    assert all(not part.extensions for part in whole)
    cut = 5
    carried = inference_pb2.InferenceRequest()
    carried.CopyFrom(original)
    carried.delivered_messages.extend(part.SerializeToString() for part in whole[:cut])
    rest = [part async for part in inference.GenerateOpenAI(carried, timeout=120)]
    undisturbed, moved = events(whole), events(whole[:cut] + rest)

    def content(chunks: list[Any]) -> str:
        return "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in chunks
            if c != "[DONE]" and c["choices"]
        )

    assert content(moved) == content(undisturbed)
    assert (
        sum(
            1
            for c in moved
            if c != "[DONE]" and c["choices"] and "role" in c["choices"][0]["delta"]
        )
        == 1
    )
    assert moved.count("[DONE]") == 1 and moved[-1] == "[DONE]"
    after = events(rest)
    assert after[0]["tokenmesh"]["resumed"] == 1
    assert moved[-2]["usage"] == undisturbed[-2]["usage"]
    assert moved[-2]["usage"]["completion_tokens"] == 40
    # A part that does not carry its Token is refused, naming it.
    bare = httpbody_pb2.HttpBody(content_type=whole[0].content_type, data=whole[0].data)
    carried.delivered_messages[0] = bare.SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        _ = [part async for part in inference.GenerateOpenAI(carried, timeout=60)]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("delivered_messages[0]"), refused.value.details()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.sampling.stop.append("."), "resume"),
        (lambda r: setattr(r.sampling.structured_outputs, "regex", "[a-z ]+"), "resume"),
        (lambda r: r.resume.choices.add(choice=1), "resume.choices"),
        (lambda r: r.resume.choices[0].token_ids.extend([5] * 20), "resume.choices[0].token_ids"),
        (lambda r: setattr(r.resume, "attempt", 0), "resume.attempt"),
        (lambda r: r.resume.choices[0].token_ids.append(10**7), "resume.token_ids[3]"),
        (lambda r: setattr(r.resume.choices[0], "finished", True), "resume.choices"),
    ],
)
async def test_a_resumption_that_cannot_continue_is_refused_naming_the_field(
    inference: inference_pb2_grpc.InferenceServiceStub,
    change: Callable[[inference_pb2.InferenceRequest], object],
    field: str,
) -> None:
    made = resumed(request(8), {0: [1576, 310, 278]})
    change(made)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stream(inference, made)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(field), refused.value.details()
