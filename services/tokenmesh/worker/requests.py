"""Validation of an InferenceRequest into the EngineRequest the engine runs (transport-agnostic)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.sampling import check_sampling, check_tools
from tokenmesh.common.validation import check_count, check_text
from tokenmesh.v1 import inference_pb2
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.sampling import VllmRequest, engine_options

# The roles a conversation's messages may have (OpenAI's, as vLLM's chat request takes them).
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    """One message of a conversation, for the model's chat template."""

    role: str
    content: str
    # An assistant message's calls: (id, function name, arguments as JSON text).
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    # A tool message's call id; the author's (or function's) name.
    tool_call_id: str = ""
    name: str = ""

    def as_openai(self) -> dict[str, Any]:
        """The message as OpenAI's chat API (and vLLM's request model) has it."""
        said: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            said["tool_calls"] = [
                {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
                for id_, name, args in self.tool_calls
            ]
            said["content"] = self.content or None
        if self.tool_call_id:
            said["tool_call_id"] = self.tool_call_id
        if self.name:
            said["name"] = self.name
        return said


@dataclass(frozen=True)
class EngineRequest:
    """A validated generation request."""

    request_id: str
    prompt: str
    max_tokens: int
    # Every other sampling option, as vLLM's own request model holds it (worker/sampling.py).
    options: VllmRequest
    logprobs: bool = False
    top_logprobs: int = 0
    # At least this many tokens per message (vLLM's stream_interval); 1: each at once.
    stream_interval: int = 1
    # Sent on the first token (the gateway's warnings for a request it prepared).
    warnings: tuple[str, ...] = ()
    # A conversation the engine renders with the model's chat template; prompt is then the
    # plain-text fallback for a model without one (empty: none, the request is refused).
    messages: tuple[Message, ...] = ()
    # max_tokens is an upper bound: at most what the context leaves after the prompt.
    max_tokens_within_context: bool = False


def validate(request: inference_pb2.InferenceRequest, settings: WorkerSettings) -> EngineRequest:
    """Check every field against the worker's limits; raise InvalidArgument naming it."""
    messages = check_messages(request.messages, settings) if request.messages else ()
    if request.prompt:
        check_text("prompt", request.prompt, settings.max_prompt_bytes)
    elif not messages:
        raise InvalidArgument("prompt", "must not be empty (or send messages instead)")
    sampling = request.sampling
    check_sampling(sampling, settings, "sampling.")
    if len(request.request_id) > settings.max_request_id_chars:
        raise InvalidArgument(
            "request_id",
            f"is {len(request.request_id)} characters, over the limit of "
            f"{settings.max_request_id_chars}",
        )
    check_count("warnings", len(request.warnings), settings.max_warnings, "warnings")
    for warning in request.warnings:
        check_text("warnings", warning, settings.max_warning_bytes)
    check_text("degraded", request.degraded, settings.max_warning_bytes, required=False)
    if request.HasField("tools"):
        if not messages:
            raise InvalidArgument("tools", "need messages (tools are for conversations)")
        check_tools("tools", request.tools, settings)
    # The engine needs ids unique among in-flight requests; a caller's id may repeat, so it
    # gets a random suffix.
    suffix = uuid.uuid4().hex[:12]
    request_id = f"{request.request_id}-{suffix}" if request.request_id else suffix
    return EngineRequest(
        request_id=request_id,
        prompt=request.prompt,
        max_tokens=sampling.max_tokens,
        options=engine_options(
            sampling,
            request.prompt,
            [message.as_openai() for message in messages],
            request.tools if request.HasField("tools") else None,
        ),
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        stream_interval=max(sampling.stream_interval, 1),
        warnings=tuple(request.warnings),
        messages=messages,
        max_tokens_within_context=sampling.max_tokens_within_context,
    )


def check_messages(
    messages: Sequence[inference_pb2.ConversationMessage], settings: WorkerSettings
) -> tuple[Message, ...]:
    """At most max_messages, each of a known role with 1..max_prompt_bytes of content, and
    max_prompt_bytes of content in all."""
    check_count("messages", len(messages), settings.max_messages, "messages")
    total = 0
    for position, message in enumerate(messages):
        if message.role not in ROLES:
            # The role is echoed cut short: it may be arbitrarily long.
            raise InvalidArgument(
                f"messages[{position}].role",
                f"must be one of {', '.join(ROLES)}, got {message.role[:32]!r}",
            )
        # An assistant's message may be its tool calls alone.
        check_text(
            f"messages[{position}].content",
            message.content,
            settings.max_prompt_bytes,
            required=not message.tool_calls,
        )
        total += len(message.content.encode()) + sum(
            len(call.arguments.encode()) for call in message.tool_calls
        )
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgument(
                f"messages[{position}].tool_calls", "only an assistant message has tool calls"
            )
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidArgument(
                f"messages[{position}].tool_call_id", "a tool message needs the call's id"
            )
    if total > settings.max_prompt_bytes:
        raise InvalidArgument(
            "messages",
            f"hold {total} bytes of content together, over the limit of "
            f"{settings.max_prompt_bytes}",
        )
    return tuple(
        Message(
            message.role,
            message.content,
            tuple((call.id, call.name, call.arguments) for call in message.tool_calls),
            message.tool_call_id,
            message.name,
        )
        for message in messages
    )


@dataclass(frozen=True)
class TokenizeSpec:
    """A validated tokenize request: a prompt, or messages and the tools they may call."""

    prompt: str
    messages: tuple[Message, ...]
    # vLLM's chat request model of the messages and tools (None for a prompt).
    options: VllmRequest | None
    add_special_tokens: bool | None
    add_generation_prompt: bool


def validate_tokenize(
    request: inference_pb2.TokenizeRequest, settings: WorkerSettings
) -> TokenizeSpec:
    """The same limits as a generation's prompt, messages and tools."""
    messages = check_messages(request.messages, settings) if request.messages else ()
    if request.prompt and messages:
        raise InvalidArgument("prompt", "send a prompt or messages, not both")
    if not messages:
        check_text("prompt", request.prompt, settings.max_prompt_bytes)
    options = None
    if messages:
        tools = request.tools if request.HasField("tools") else None
        if tools is not None:
            check_tools("tools", tools, settings)
        options = engine_options(
            inference_pb2.SamplingParams(max_tokens=1),
            "",
            [message.as_openai() for message in messages],
            tools,
        )
    elif request.HasField("tools"):
        raise InvalidArgument("tools", "need messages (tools are for conversations)")
    return TokenizeSpec(
        prompt=request.prompt,
        messages=messages,
        options=options,
        add_special_tokens=(
            request.add_special_tokens if request.HasField("add_special_tokens") else None
        ),
        add_generation_prompt=(
            request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        ),
    )


def check_token_ids(field: str, ids: Sequence[int], vocabulary: int, max_count: int) -> None:
    """At most max_count ids, each inside the vocabulary."""
    check_count(field, len(ids), max_count, "tokens")
    for position, token_id in enumerate(ids):
        if not 0 <= token_id < vocabulary:
            raise InvalidArgument(
                f"{field}[{position}]",
                f"must be a vocabulary id in [0, {vocabulary}), got {token_id}",
            )
