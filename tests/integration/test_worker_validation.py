"""Bad requests get INVALID_ARGUMENT naming the field and the limit, and never reach the engine."""

from __future__ import annotations

import grpc
import pytest

from tokenmesh.v1 import inference_pb2

pytestmark = pytest.mark.integration

CASES = {
    "empty prompt": (dict(prompt=""), {}, "prompt: must not be empty"),
    "max_tokens zero": (dict(), dict(max_tokens=0), "sampling.max_tokens: must be in [1, 4096]"),
    "max_tokens over cap": (dict(), dict(max_tokens=5000), "got 5000"),
    "negative temperature": (dict(), dict(temperature=-0.5), "sampling.temperature"),
    "temperature over 2": (dict(), dict(temperature=2.5), "must be in [0, 2]"),
    "temperature NaN": (dict(), dict(temperature=float("nan")), "sampling.temperature"),
    "top_p zero": (dict(), dict(top_p=0.0), "sampling.top_p: must be in (0, 1]"),
    "top_k below -1": (dict(), dict(top_k=-2), "sampling.top_k"),
    "min_tokens over max_tokens": (dict(), dict(max_tokens=4, min_tokens=5), "sampling.min_tokens"),
    "presence_penalty out of vLLM's range": (
        dict(),
        dict(presence_penalty=2.5),
        "presence_penalty: presence_penalty must be in [-2, 2], got 2.5",
    ),
    "a token id outside the vocabulary": (
        dict(),
        dict(allowed_token_ids=[10**6]),
        "allowed_token_ids: ",
    ),
    "too many stops": (dict(), dict(stop=["a"] * 9), "over the limit of 8"),
    "empty stop": (dict(), dict(stop=[""]), "sampling.stop[0]"),
    "prompt over byte limit": (dict(prompt="x" * (256 * 1024 + 1)), {}, "over the limit of 262144"),
    "request id too long": (dict(request_id="r" * 129), {}, "request_id"),
    "too many warnings": (
        dict(warnings=["w"] * 9),
        {},
        "warnings: has 9 warnings, over the limit of 8",
    ),
    "warning too long": (
        dict(warnings=["w" * 1025]),
        {},
        "warnings: is 1025 bytes, over the limit of 1024",
    ),
    # ~3000 tokens of text: longer than the 2048-token model context.
    "prompt longer than context": (
        dict(prompt=" ".join(f"w{i}" for i in range(3000))),
        {},
        "the model context is 2048 tokens",
    ),
    "prompt plus max_tokens over context": (
        dict(prompt=" ".join(f"w{i}" for i in range(400))),
        dict(max_tokens=2000),
        "exceeds the model context of 2048 tokens",
    ),
}


@pytest.mark.parametrize("case", CASES)
async def test_invalid_request_is_rejected_with_field_and_limit(inference, case: str) -> None:
    request_fields, sampling_fields, expected = CASES[case]
    sampling = {"max_tokens": 8, **sampling_fields}
    request = inference_pb2.InferenceRequest(
        **{"prompt": "hello", **request_fields},
        sampling=inference_pb2.SamplingParams(**sampling),
    )
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in inference.Generate(request, timeout=30):
            pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.value.details()


def conversation(*messages: tuple[str, str]) -> list[inference_pb2.ConversationMessage]:
    return [
        inference_pb2.ConversationMessage(role=role, content=content) for role, content in messages
    ]


# Each: request fields, sampling fields, the field the error names, and what it says.
MESSAGE_CASES = {
    "unknown role": (
        dict(messages=conversation(("system", "s"), ("developer", "t"))),
        {},
        "messages[1].role",
        "must be one of system, user, assistant, tool, got 'developer'",
    ),
    "tool result without its call": (
        dict(messages=conversation(("user", "u"), ("tool", "42"))),
        {},
        "messages[1].tool_call_id",
        "a tool message needs the call's id",
    ),
    "tools without messages": (
        dict(prompt="p", tools=inference_pb2.ToolCalling(tools_json="[]")),
        {},
        "tools",
        "need messages (tools are for conversations)",
    ),
    "tools not a list": (
        dict(
            messages=conversation(("user", "u")), tools=inference_pb2.ToolCalling(tools_json="{}")
        ),
        {},
        "tools.tools_json",
        "must be a JSON array of tools",
    ),
    "empty content": (
        dict(messages=conversation(("user", ""))),
        {},
        "messages[0].content",
        "must not be empty",
    ),
    "too many messages": (
        dict(messages=conversation(*[("user", "hi")] * 65)),
        {},
        "messages",
        "has 65 messages, over the limit of 64",
    ),
    "content over byte limit": (
        dict(messages=conversation(("user", "x" * (256 * 1024 + 1)))),
        {},
        "messages[0].content",
        "is 262145 bytes, over the limit of 262144",
    ),
    "messages over byte limit together": (
        dict(messages=conversation(("user", "x" * (128 * 1024)), ("user", "y" * (128 * 1024 + 1)))),
        {},
        "messages",
        "hold 262145 bytes of content together, over the limit of 262144",
    ),
    # The context checks count the prompt the chat template renders (in the engine).
    "messages longer than context": (
        dict(messages=conversation(("user", " ".join(f"w{i}" for i in range(3000))))),
        {},
        "messages",
        "tokens with the chat template; the model context is 2048 tokens",
    ),
    "messages plus max_tokens over context": (
        dict(messages=conversation(("user", " ".join(f"w{i}" for i in range(400))))),
        dict(max_tokens=2000),
        "max_tokens",
        "exceeds the model context of 2048 tokens",
    ),
}


@pytest.mark.parametrize("case", MESSAGE_CASES)
async def test_invalid_messages_are_rejected_naming_the_field(inference, case: str) -> None:
    request_fields, sampling_fields, field, expected = MESSAGE_CASES[case]
    request = inference_pb2.InferenceRequest(
        **request_fields,
        sampling=inference_pb2.SamplingParams(**{"max_tokens": 8, **sampling_fields}),
    )
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in inference.Generate(request, timeout=30):
            pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(f"{field}: ")
    assert expected in error.value.details()


async def test_rejected_requests_leave_the_engine_empty(inference) -> None:
    report = await inference.GetEngineStats(inference_pb2.EngineStatsRequest(), timeout=30)
    assert report.running_requests == 0 and report.waiting_requests == 0
