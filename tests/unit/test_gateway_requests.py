"""Public request validation and prompt assembly at the gateway (pure logic)."""

from __future__ import annotations

import logging

import pytest

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.documents import ContextPrompt
from tokenmesh.gateway.core.prepare import PROMPT_LOGGER, Preparer
from tokenmesh.gateway.core.prompts import (
    ChatHistory,
    ChatTurn,
    Conversation,
    context_question,
    with_context,
)
from tokenmesh.gateway.core.requests import question
from tokenmesh.v1 import inference_pb2, llm_pb2

LIMITS = GatewaySettings(
    max_documents=4, max_document_bytes=10, max_top_k_documents=3, default_top_k_documents=2
)


def job(**fields: object):
    return question(llm_pb2.GenerateRequest(**{"prompt": "q", "max_tokens": 4, **fields}), LIMITS)


def test_defaults_and_sampling_pass_through() -> None:
    result = job(documents=["a", "b"], temperature=0.0, seed=7, stop=["x"])
    assert result.top_k_documents == 2
    assert result.sampling.max_tokens == 4
    assert result.sampling.HasField("temperature") and result.sampling.temperature == 0.0
    assert result.sampling.seed == 7 and list(result.sampling.stop) == ["x"]
    assert not result.sampling.logprobs
    asked = job(logprobs=True, top_logprobs=5).sampling
    assert asked.logprobs and asked.top_logprobs == 5


@pytest.mark.parametrize(
    ("fields", "field", "limit"),
    [
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"max_tokens": 0}, "max_tokens", "[1, 4096]"),
        ({"temperature": 3.0}, "temperature", "[0, 2]"),
        ({"documents": ["a"] * 5}, "documents", "over the limit of 4"),
        ({"documents": ["ok", "x" * 11]}, "documents[1]", "over the limit of 10"),
        ({"documents": ["ok", ""]}, "documents[1]", "must not be empty"),
        ({"top_k_documents": 4}, "top_k_documents", "[0, 3]"),
        ({"top_k_documents": -1}, "top_k_documents", "[0, 3]"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs set to true"),
        ({"stream_interval": 65}, "stream_interval", "[0, 64], got 65"),
        ({"stream_interval": -2}, "stream_interval", "[0, 64], got -2"),
        ({"max_tokens": -5}, "max_tokens", "[1, 4096]"),
        ({"temperature": float("nan")}, "temperature", "[0, 2]"),
        ({"temperature": float("-inf")}, "temperature", "[0, 2]"),
        ({"top_p": float("inf")}, "top_p", "(0, 1]"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"stop": ["s"] * 9}, "stop", "over the limit of 8"),
        ({"stop": ["ok", ""]}, "stop[1]", "must be 1..256 bytes"),
        ({"stop": ["é" * 129]}, "stop[0]", "must be 1..256 bytes, got 258"),
        ({"prompt": "x" * (32 * 1024 + 1)}, "prompt", "over the limit of 32768"),
    ],
)
def test_invalid_fields_name_field_and_limit(
    fields: dict[str, object], field: str, limit: str
) -> None:
    with pytest.raises(InvalidArgument) as error:
        job(**fields)
    assert error.value.field == field
    assert limit in error.value.message


def test_context_lists_documents_in_order() -> None:
    prompt = with_context("Why?", ["first doc", "second doc"])
    assert prompt.index("[1] first doc") < prompt.index("[2] second doc") < prompt.index("Why?")
    assert prompt.endswith("\nAnswer:")
    assert with_context("plain", []) == "plain"


def test_a_question_with_context_is_one_user_message_with_the_plain_prompt_as_fallback() -> None:
    prepared = ContextPrompt("Why?", ("first doc", "second doc"), (1, 0))
    prompt = prepared.prompt
    assert isinstance(prompt, Conversation)
    (question,) = prompt.messages
    assert question.role == "user"
    assert question.content == context_question("Why?", ["first doc", "second doc"])
    assert not question.content.endswith("Answer:")
    assert prompt.fallback == with_context("Why?", ["first doc", "second doc"])
    assert ContextPrompt("Why?", (), ()).prompt == "Why?"


def test_chat_history_drops_oldest_turns_past_the_turn_bound() -> None:
    history = ChatHistory(max_turns=2, max_tokens=1000)
    assert history.add(ChatTurn("u1", "a1", 10)) == 0
    assert history.add(ChatTurn("u2", "a2", 10)) == 0
    assert history.add(ChatTurn("u3", "a3", 10)) == 1
    conversation = history.conversation("u4")
    assert [(m.role, m.content) for m in conversation.messages] == [
        ("user", "u2"),
        ("assistant", "a2"),
        ("user", "u3"),
        ("assistant", "a3"),
        ("user", "u4"),
    ]
    assert (
        conversation.fallback
        == "User: u2\nAssistant: a2\nUser: u3\nAssistant: a3\nUser: u4\nAssistant:"
    )


def test_a_turn_cancelled_before_its_first_token_is_left_out_of_the_conversation() -> None:
    history = ChatHistory(max_turns=10, max_tokens=1000)
    history.add(ChatTurn("u1", "", 3))
    history.add(ChatTurn("u2", "a2", 10))
    conversation = history.conversation("u3")
    assert [m.content for m in conversation.messages] == ["u2", "a2", "u3"]
    assert "u1" not in conversation.fallback


def test_chat_history_keeps_no_tokens_for_a_turn_the_conversation_leaves_out() -> None:
    history = ChatHistory(max_turns=2, max_tokens=25)
    history.add(ChatTurn("u1", "a1", 10))
    # Its prompt and any tokens that made no text yet: none of it is sent with the next turn.
    assert history.add(ChatTurn("u2", "", 20)) == 0
    assert history.tokens == 10 and len(history) == 1
    assert history.add(ChatTurn("u3", "a3", 10)) == 0
    assert [m.content for m in history.conversation("u4").messages] == [
        "u1",
        "a1",
        "u3",
        "a3",
        "u4",
    ]


def test_chat_history_drops_oldest_turns_past_the_token_bound() -> None:
    history = ChatHistory(max_turns=10, max_tokens=25)
    history.add(ChatTurn("u1", "a1", 10))
    history.add(ChatTurn("u2", "a2", 10))
    assert history.add(ChatTurn("u3", "a3", 10)) == 1
    assert history.tokens == 20 and len(history) == 2


@pytest.mark.parametrize("enabled", [False, True])
def test_prompts_are_logged_only_when_log_prompts_is_on(
    enabled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    preparer = Preparer(None, GatewaySettings(log_prompts=enabled), None)  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG):
        preparer.call("the secret prompt", inference_pb2.SamplingParams(max_tokens=1))
    logged = [getattr(record, "prompt", "") for record in caplog.records]
    assert ("the secret prompt" in logged) is enabled
    assert all(record.name == PROMPT_LOGGER for record in caplog.records)
    # Named apart from the RPC log line's request_id (Envoy's id of the call).
    assert all(
        len(getattr(record, "engine_request_id", "")) == 16 and not hasattr(record, "request_id")
        for record in caplog.records
    )
