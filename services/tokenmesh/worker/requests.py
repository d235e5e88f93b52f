"""Validation of an InferenceRequest into the EngineRequest the engine runs (transport-agnostic)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.sampling import check_batch, check_sampling, check_tools
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
class PromptItem:
    """One prompt of a batch: its text, or the vocabulary ids the model sees."""

    text: str = ""
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Continuation:
    """A choice a resumed stream continues: its number and the tokens it had delivered."""

    choice: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Resumed:
    """What a resumed stream continues (inference.proto's Resumption): its unfinished choices,
    and how many tokens every choice had delivered (usage counts them as generated)."""

    continuations: tuple[Continuation, ...]
    delivered: int
    attempt: int


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
    # A batch of prompts instead of prompt (each its own engine request with n choices), or
    # one prompt of ids (batch False).
    prompts: tuple[PromptItem, ...] = ()
    batch: bool = False
    # Choices per prompt (1 unless the request asked for several).
    n: int = 1
    # Each choice's first tokens carry the prompt (its text too with echo); prompt_logprobs:
    # the prompt tokens' logprobs and this many alternatives (None: not asked for).
    echo: bool = False
    prompt_logprobs: int | None = None
    # Echo with max_tokens 0: each choice answers its prompt alone (its generated token left
    # out, and not counted).
    echo_only: bool = False
    # A stream another worker began: its choices continue after what they delivered.
    resumed: Resumed | None = None
    # The model the request names (InferenceRequest.model): empty or the worker's model, or one
    # of its LoRA adapters (the engine's Adapters resolve it).
    model: str = ""

    @property
    def engine_ids(self) -> tuple[str, ...]:
        """The engine's request ids: one per prompt of a batch; a resumed stream's, one per
        choice it continues."""
        if self.resumed is not None:
            return tuple(self.engine_id(c.choice // self.n, c) for c in self.resumed.continuations)
        if not self.batch:
            return (self.request_id,)
        return tuple(self.engine_id(i) for i in range(len(self.prompts)))

    def engine_id(self, position: int, continuation: Continuation | None = None) -> str:
        """The engine's id of a prompt's request, or of one choice's continuation."""
        made = f"{self.request_id}-{position}" if self.batch else self.request_id
        return made if continuation is None else f"{made}-c{continuation.choice}"

    def prompt_field(self, position: int) -> str:
        """The caller's name of a prompt: prompt[i] in a batch, else prompt."""
        return f"prompt[{position}]" if self.batch else "prompt"

    @property
    def prompt_features(self) -> list[str]:
        """The prompt features the request uses, as the worker counts them."""
        used = []
        if self.prompts:
            used.append("prompt_batch" if self.batch else "prompt_token_ids")
        if self.echo:
            used.append("echo")
        if self.prompt_logprobs is not None:
            used.append("prompt_logprobs")
        return used

    @property
    def wants_prompt(self) -> bool:
        return self.echo or self.prompt_logprobs is not None


def validate(request: inference_pb2.InferenceRequest, settings: WorkerSettings) -> EngineRequest:
    """Check every field against the worker's limits; raise InvalidArgument naming it."""
    messages = check_messages(request.messages, settings) if request.messages else ()
    sampling = request.sampling
    prompts = check_prompts(request, settings)
    if request.prompt:
        check_text("prompt", request.prompt, settings.max_prompt_bytes)
    elif not messages and not prompts:
        raise InvalidArgument("prompt", "must not be empty (or send messages instead)")
    if sampling.HasField("prompt_logprobs") and request.openai.stream:
        # As vLLM's server: a stream's chunks have no place for them.
        raise InvalidArgument("prompt_logprobs", "not available when stream is true")
    check_sampling(sampling, settings, "sampling.")
    if sampling.echo and messages:
        raise InvalidArgument("sampling.echo", "echoes a prompt, not messages")
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
    check_text("model", request.model, settings.max_model_name_bytes, required=False)
    if request.HasField("tools"):
        if not messages:
            raise InvalidArgument("tools", "need messages (tools are for conversations)")
        check_tools("tools", request.tools, settings)
    resumed = check_resume(request, len(prompts) if request.prompts else 1)
    # The engine needs ids unique among in-flight requests; a caller's id may repeat, so it
    # gets a random suffix.
    suffix = uuid.uuid4().hex[:12]
    request_id = f"{request.request_id}-{suffix}" if request.request_id else suffix
    first = prompts[0] if prompts else None
    return EngineRequest(
        request_id=request_id,
        prompt=request.prompt,
        # Echo with max_tokens 0: one token generated, the prompt alone answered (vLLM's way).
        max_tokens=max(sampling.max_tokens, 1),
        options=engine_options(
            sampling,
            # What vLLM's request model validates (a batch's prompts are tokenized one by one).
            request.prompt if first is None else (first.text or list(first.token_ids)),
            [message.as_openai() for message in messages],
            request.tools if request.HasField("tools") else None,
        ),
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        stream_interval=max(sampling.stream_interval, 1),
        warnings=tuple(request.warnings),
        messages=messages,
        max_tokens_within_context=sampling.max_tokens_within_context,
        prompts=prompts,
        batch=bool(request.prompts),
        n=max(sampling.n, 1),
        echo=sampling.echo,
        echo_only=sampling.echo and sampling.max_tokens == 0,
        prompt_logprobs=(
            sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None
        ),
        resumed=resumed,
        model=request.model,
    )


def check_resume(request: inference_pb2.InferenceRequest, prompt_count: int) -> Resumed | None:
    """A resumed stream's delivered tokens: every choice of the request listed once, none
    past max_tokens. A constraint whose state lives in the first worker's engine (structured
    outputs, forced tool calls) or text it may have held back (stop strings) cannot continue
    elsewhere: refused, so the stream ends with this error instead of output that breaks it."""
    if not request.HasField("resume"):
        return None
    resume, sampling = request.resume, request.sampling
    held = [
        (bool(sampling.HasField("structured_outputs")), "structured outputs"),
        (request.HasField("tools"), "tools"),
        (bool(sampling.stop), "stop strings"),
        (sampling.max_tokens == 0, "max_tokens 0"),
    ]
    for used, what in held:
        if used:
            raise InvalidArgument(
                "resume", f"a stream with {what} cannot continue on another worker"
            )
    if resume.attempt < 1:
        raise InvalidArgument("resume.attempt", f"must be 1 or more, got {resume.attempt}")
    choices = max(sampling.n, 1) * prompt_count
    numbers = sorted(choice.choice for choice in resume.choices)
    if numbers != list(range(choices)):
        raise InvalidArgument(
            "resume.choices", f"must list choices 0..{choices - 1} once each, got {numbers}"
        )
    continuations = []
    for position, choice in enumerate(resume.choices):
        if len(choice.token_ids) > sampling.max_tokens:
            raise InvalidArgument(
                f"resume.choices[{position}].token_ids",
                f"are {len(choice.token_ids)} tokens, over max_tokens ({sampling.max_tokens})",
            )
        if not choice.finished:
            continuations.append(Continuation(choice.choice, tuple(choice.token_ids)))
    if not continuations:
        raise InvalidArgument("resume.choices", "every choice had ended: nothing to continue")
    return Resumed(
        tuple(continuations),
        sum(len(choice.token_ids) for choice in resume.choices),
        resume.attempt,
    )


def check_prompts(
    request: inference_pb2.InferenceRequest, settings: WorkerSettings
) -> tuple[PromptItem, ...]:
    """A batch's prompts, instead of prompt and messages (common/sampling.py's limits; the
    engine checks each prompt's ids against the model context and the vocabulary)."""
    if request.prompt_token_ids:
        if request.prompt or request.messages or request.prompts:
            raise InvalidArgument(
                "prompt_token_ids", "send prompt_token_ids, prompts, a prompt or messages"
            )
        return (PromptItem(token_ids=tuple(request.prompt_token_ids)),)
    if not request.prompts:
        return ()
    if request.prompt or request.messages:
        raise InvalidArgument("prompts", "send prompts, a prompt or messages, one of them")
    check_batch(request.prompts, request.sampling.n, settings, settings.max_prompt_bytes)
    return tuple(PromptItem(item.text, tuple(item.token_ids)) for item in request.prompts)


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
