"""Validation of worker requests (pure logic, no engine)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.sampling_params import RequestOutputKind

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2, token_pb2
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.requests import EngineRequest, Message, validate
from tokenmesh.worker.sampling import EngineSampling


def FakeLLM() -> Any:
    """What EngineSampling reads of an AsyncLLM, for checks that need no model: no
    structured-output backend (vLLM then checks no constraint against a model)."""
    return SimpleNamespace(
        model_config=None,
        vllm_config=SimpleNamespace(structured_outputs_config=None),
        renderer=SimpleNamespace(tokenizer=None),
    )


LIMITS = WorkerSettings(max_tokens_cap=100, default_temperature=0.7)


def request(**sampling: object) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        prompt="hi", sampling=inference_pb2.SamplingParams(**{"max_tokens": 5, **sampling})
    )


def engine_params(spec: EngineRequest, defaults: dict[str, object] | None = None) -> Any:
    """The vLLM SamplingParams the engine makes of a spec (vLLM's own to_sampling_params)."""
    return spec.options.to_sampling_params(spec.max_tokens, defaults or {"temperature": 0.7})


def test_unset_optionals_take_the_worker_defaults_and_vllms() -> None:
    params = engine_params(validate(request(), LIMITS))
    assert params.temperature == pytest.approx(0.7) and params.top_p == 1.0
    assert params.top_k == 0 and params.seed is None and params.stop == []
    assert params.presence_penalty == 0.0 and params.repetition_penalty == 1.0
    assert params.structured_outputs is None and params.logit_bias is None


def test_explicit_zero_temperature_means_greedy_not_default() -> None:
    assert engine_params(validate(request(temperature=0.0), LIMITS)).temperature == 0.0


def test_every_sampling_field_reaches_vllm_by_its_name() -> None:
    message = request(
        temperature=0.5,
        top_p=0.9,
        top_k=7,
        seed=2**40,
        stop=["x"],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=2,
        stop_token_ids=[3],
        bad_words=["no"],
        allowed_token_ids=[4, 5],
        logit_bias={4: 10.0},
        include_stop_str_in_output=True,
        logprobs=True,
        top_logprobs=2,
        stream_interval=4,
        structured_outputs=token_pb2.StructuredOutputs(regex="[ab]+"),
    )
    params = engine_params(validate(message, LIMITS))
    assert (params.top_k, params.seed, params.stop, params.ignore_eos) == (7, 2**40, ["x"], True)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == pytest.approx(1.2)
    assert params.min_p == pytest.approx(0.1) and params.min_tokens == 2
    assert (params.stop_token_ids, params.bad_words) == ([3], ["no"])
    assert params.allowed_token_ids == [4, 5] and params.logit_bias == {4: 10.0}
    assert params.include_stop_str_in_output and params.logprobs == 2
    assert params.stream_interval == 4 and params.max_tokens == 5
    assert params.structured_outputs is not None and params.structured_outputs.regex == "[ab]+"
    # Deltas: the token stream.
    assert params.output_kind == RequestOutputKind.DELTA


def test_a_conversation_becomes_vllms_chat_request_with_its_logprobs_shape() -> None:
    message = chat_request(("user", "hi"))
    message.sampling.logprobs, message.sampling.top_logprobs = True, 3
    spec = validate(message, LIMITS)
    assert spec.options.messages == [{"role": "user", "content": "hi"}]
    assert engine_params(spec).logprobs == 3


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        (
            {"structured_outputs": token_pb2.StructuredOutputs(regex="a", choice=["b"])},
            "structured_outputs",
        ),
    ],
)
def test_what_vllm_refuses_is_refused_naming_the_field(
    sampling: dict[str, object], field: str
) -> None:
    """vLLM's own checks (its request model, its SamplingParams) with the field named."""
    with pytest.raises(InvalidArgument) as error:
        spec = validate(request(**sampling), LIMITS)
        EngineSampling(FakeLLM(), {}).params(spec.options, spec.max_tokens)
    assert error.value.field == field


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
        ({"min_tokens": 6}, "sampling.min_tokens"),
        ({"repetition_penalty": float("nan")}, "sampling.repetition_penalty"),
        ({"logit_bias": {3: 101.0}}, "sampling.logit_bias[3]"),
        ({"stop_token_ids": [-1]}, "sampling.stop_token_ids"),
        ({"allowed_token_ids": list(range(1025))}, "sampling.allowed_token_ids"),
        ({"bad_words": [""]}, "sampling.bad_words[0]"),
        (
            {"structured_outputs": token_pb2.StructuredOutputs(json="x" * 65537)},
            "sampling.structured_outputs",
        ),
        ({"structured_outputs": token_pb2.StructuredOutputs()}, "sampling.structured_outputs"),
        ({"n": 17}, "sampling.n"),
        ({"n": -1}, "sampling.n"),
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


@pytest.mark.parametrize("role", ["developer", "", "User", "x" * 100])
def test_unknown_roles_are_rejected_naming_the_message(role: str) -> None:
    error = rejection(chat_request(("system", "s"), ("user", "u"), (role, "c")))
    assert error.field == "messages[2].role"
    assert error.message.startswith(
        "messages[2].role: must be one of system, user, assistant, tool, got "
    )
    # A long role is echoed cut short.
    assert len(error.message) < 110


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


def test_a_batch_and_a_prompt_of_ids_become_prompt_items_named_as_the_caller_names_them() -> None:
    sampling = inference_pb2.SamplingParams(max_tokens=5, n=2, temperature=1.0)
    batch = validate(
        inference_pb2.InferenceRequest(
            prompts=[
                inference_pb2.PromptInput(text="a"),
                inference_pb2.PromptInput(token_ids=[3, 4]),
            ],
            sampling=sampling,
        ),
        LIMITS,
    )
    assert [(item.text, item.token_ids) for item in batch.prompts] == [("a", ()), ("", (3, 4))]
    assert batch.n == 2 and batch.prompt_field(1) == "prompt[1]"
    assert len(set(batch.engine_ids)) == 2 and all(batch.request_id in i for i in batch.engine_ids)
    ids = validate(
        inference_pb2.InferenceRequest(prompt_token_ids=[3, 4], sampling=sampling), LIMITS
    )
    assert ids.prompts[0].token_ids == (3, 4) and ids.prompt_field(0) == "prompt"
    assert ids.engine_ids == (ids.request_id,)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt": "a", "prompts": [inference_pb2.PromptInput(text="b")]}, "prompts"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt_token_ids"),
        ({"prompts": [inference_pb2.PromptInput(text="b", token_ids=[1])]}, "prompt[0]"),
        ({"prompts": [inference_pb2.PromptInput(text="b")] * 17}, "prompt"),
        ({"prompts": [inference_pb2.PromptInput()]}, "prompt[0]"),
    ],
)
def test_a_batch_that_is_not_one_is_refused_naming_the_field(
    fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgument) as error:
        validate(
            inference_pb2.InferenceRequest(
                sampling=inference_pb2.SamplingParams(max_tokens=5), **fields
            ),
            LIMITS,
        )
    assert error.value.field == field


def test_echo_is_a_prompts_and_prompt_logprobs_a_whole_answers() -> None:
    with pytest.raises(InvalidArgument) as error:
        validate(
            inference_pb2.InferenceRequest(
                messages=[inference_pb2.ConversationMessage(role="user", content="hi")],
                sampling=inference_pb2.SamplingParams(max_tokens=5, echo=True),
            ),
            LIMITS,
        )
    assert error.value.field == "sampling.echo"
    streamed = request(prompt_logprobs=1)
    streamed.openai.stream = True
    with pytest.raises(InvalidArgument) as error:
        validate(streamed, LIMITS)
    assert error.value.field == "prompt_logprobs"
    with pytest.raises(InvalidArgument) as error:
        validate(request(prompt_logprobs=21), LIMITS)
    assert error.value.field == "sampling.prompt_logprobs"
    spec = validate(request(prompt_logprobs=0, echo=True), LIMITS)
    assert spec.echo and spec.prompt_logprobs == 0 and spec.wants_prompt
    assert not validate(request(), LIMITS).wants_prompt
