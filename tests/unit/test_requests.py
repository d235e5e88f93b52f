"""Validation of worker requests (pure logic, no engine)."""

from __future__ import annotations

import pytest

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.requests import Message, validate

LIMITS = WorkerSettings(max_tokens_cap=100, default_temperature=0.7)


def request(**sampling: object) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        prompt="hi", sampling=inference_pb2.SamplingParams(**{"max_tokens": 5, **sampling})
    )


def test_unset_optionals_take_defaults() -> None:
    spec = validate(request(), LIMITS)
    assert spec.temperature == 0.7 and spec.top_p == 1.0 and spec.top_k == -1
    assert spec.seed is None and spec.stop == ()


def test_explicit_zero_temperature_means_greedy_not_default() -> None:
    assert validate(request(temperature=0.0), LIMITS).temperature == 0.0


def test_request_ids_are_unique_and_keep_the_callers_prefix() -> None:
    message = request()
    message.request_id = "abc"
    first, second = validate(message, LIMITS), validate(message, LIMITS)
    assert first.request_id.startswith("abc-") and first.request_id != second.request_id


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"max_tokens": 101}, "sampling.max_tokens"),
        ({"max_tokens": -1}, "sampling.max_tokens"),
        ({"temperature": float("inf")}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"logprobs": True, "top_logprobs": 21}, "sampling.top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "sampling.top_logprobs"),
        ({"top_logprobs": 3}, "sampling.top_logprobs"),
        ({"stream_interval": 65}, "sampling.stream_interval"),
        ({"stream_interval": -1}, "sampling.stream_interval"),
    ],
)
def test_out_of_range_fields_name_the_field(sampling: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        validate(request(**sampling), LIMITS)
    assert error.value.field == field
    assert error.value.message.startswith(f"{field}: ")


def test_stream_interval_passes_through_within_the_cap() -> None:
    assert validate(request(stream_interval=64), LIMITS).stream_interval == 64
    # 0 (unset) and 1 both mean every token at once.
    assert validate(request(), LIMITS).stream_interval == 1


def test_logprobs_pass_through_within_the_cap() -> None:
    spec = validate(request(logprobs=True, top_logprobs=20), LIMITS)
    assert spec.logprobs and spec.top_logprobs == 20
    assert not validate(request(), LIMITS).logprobs


CHAT_LIMITS = WorkerSettings(max_messages=3, max_prompt_bytes=10)


def chat_request(*messages: tuple[str, str], prompt: str = "") -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        prompt=prompt,
        messages=[
            inference_pb2.ConversationMessage(role=role, content=content)
            for role, content in messages
        ],
        sampling=inference_pb2.SamplingParams(max_tokens=5),
    )


def rejection(message: inference_pb2.InferenceRequest) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as error:
        validate(message, CHAT_LIMITS)
    return error.value


def test_messages_reach_the_spec_in_order_with_no_prompt() -> None:
    spec = validate(chat_request(("system", "be brief"), ("user", "hi")), CHAT_LIMITS)
    assert spec.prompt == ""
    assert spec.messages == (Message("system", "be brief"), Message("user", "hi"))
    assert validate(request(), LIMITS).messages == ()


def test_a_prompt_beside_messages_is_kept_as_their_plain_fallback() -> None:
    spec = validate(chat_request(("user", "hi"), prompt="User: hi"), CHAT_LIMITS)
    assert spec.prompt == "User: hi"
    assert spec.messages == (Message("user", "hi"),)


def test_a_fallback_prompt_is_held_to_the_prompt_limit() -> None:
    oversized = "x" * (CHAT_LIMITS.max_prompt_bytes + 1)
    error = rejection(chat_request(("user", "hi"), prompt=oversized))
    assert error.field == "prompt"


def test_max_tokens_within_context_reaches_the_spec() -> None:
    message = request()
    message.sampling.max_tokens_within_context = True
    assert validate(message, LIMITS).max_tokens_within_context
    assert not validate(request(), LIMITS).max_tokens_within_context


def test_neither_prompt_nor_messages_is_rejected_naming_prompt() -> None:
    error = rejection(chat_request())
    assert error.field == "prompt"
    assert error.message.startswith("prompt: must not be empty")


@pytest.mark.parametrize("role", ["tool", "developer", "", "User", "x" * 100])
def test_unknown_roles_are_rejected_naming_the_message(role: str) -> None:
    error = rejection(chat_request(("system", "s"), ("user", "u"), (role, "c")))
    assert error.field == "messages[2].role"
    assert error.message.startswith(
        "messages[2].role: must be one of system, user, assistant, got "
    )
    # A long role is echoed cut short.
    assert len(error.message) < 100


def test_more_messages_than_the_cap_are_rejected_with_the_limit() -> None:
    error = rejection(chat_request(*[("user", "u")] * 4))
    assert error.field == "messages"
    assert error.message == "messages: has 4 messages, over the limit of 3"
    assert validate(chat_request(*[("user", "u")] * 3), CHAT_LIMITS).messages


def test_a_message_over_the_byte_limit_is_rejected_naming_it() -> None:
    error = rejection(chat_request(("user", "u"), ("assistant", "a" * 11)))
    assert error.field == "messages[1].content"
    assert error.message == "messages[1].content: is 11 bytes, over the limit of 10"


def test_an_empty_message_is_rejected_naming_it() -> None:
    error = rejection(chat_request(("user", "")))
    assert error.message == "messages[0].content: must not be empty"


def test_messages_over_the_byte_limit_together_are_rejected() -> None:
    # 4 + 4 + 3 bytes: each within the limit of 10, 11 together ("é" is two bytes).
    error = rejection(chat_request(("user", "uuuu"), ("assistant", "aaaa"), ("user", "éu")))
    assert error.field == "messages"
    assert error.message == ("messages: hold 11 bytes of content together, over the limit of 10")
