"""OpenAI completions and chat completions: request models, and the requests they become."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.gateway.core.prompts import message as conversation_message
from tokenmesh.v1 import inference_pb2, llm_pb2

# OpenAI's default for /v1/completions when max_tokens is left out.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ROLES = ("system", "user", "assistant")
# What the protobuf fields these numbers go into hold: past it, a request is refused naming the
# field (400), never failed as an internal error.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Request(BaseModel):
    """The fields both endpoints share. Fields OpenAI or vLLM accept that change nothing here
    (user, frequency_penalty 0, ...) are ignored, as vLLM's server ignores unknown ones; those
    that would change the answer and are not supported are refused by name (unsupported())."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # tokenmesh's extras: context documents (reranked, best top_k_documents kept) and
    # generating to max_tokens whatever the model would end with.
    documents: list[str] = Field(default_factory=list)
    top_k_documents: Int32 = 0
    ignore_eos: bool = False

    def unsupported(self) -> None:
        if self.n != 1:
            raise InvalidArgument("n", f"only 1 choice per request is supported, got {self.n}")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise InvalidArgument(name, "not supported (only 0)")
        if self.logit_bias:
            raise InvalidArgument("logit_bias", "not supported")
        for name in ("tools", "functions", "suffix", "echo", "best_of"):
            if (self.model_extra or {}).get(name) not in (None, [], False, 1):
                raise InvalidArgument(name, "not supported")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _generate_request(self, prompt: str, max_tokens: int) -> llm_pb2.GenerateRequest:
        request = llm_pb2.GenerateRequest(
            prompt=prompt,
            max_tokens=max_tokens,
            documents=self.documents,
            top_k_documents=self.top_k_documents,
            ignore_eos=self.ignore_eos,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
        )
        if self.temperature is not None:
            request.temperature = self.temperature
        if self.top_p is not None:
            request.top_p = self.top_p
        if self.seed is not None:
            request.seed = self.seed
        return request


class CompletionRequest(_Request):
    prompt: str
    # OpenAI's completions take the number of alternatives to return (0..5).
    logprobs: Int32 | None = None

    def generate_request(self, max_tokens_cap: int) -> llm_pb2.GenerateRequest:
        self.unsupported()
        request = self._generate_request(
            self.prompt,
            COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens,
        )
        if self.logprobs is not None:
            request.logprobs = True
            request.top_logprobs = self.logprobs
        return request


class ChatCompletionRequest(_Request):
    messages: list[Message]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None

    def generate_request(self, max_tokens_cap: int) -> llm_pb2.GenerateRequest:
        """The request as a Generate of its last user message (what documents are ranked
        against); the conversation itself goes to the worker as messages()."""
        self.unsupported()
        response_format = (self.model_extra or {}).get("response_format")
        if response_format not in (None, {"type": "text"}):
            raise InvalidArgument("response_format", 'only {"type": "text"} is supported')
        if not self.messages:
            raise InvalidArgument("messages", "at least one message is required")
        for position, message in enumerate(self.messages):
            if message.role not in ROLES:
                raise InvalidArgument(
                    f"messages[{position}].role",
                    f"must be one of {', '.join(ROLES)}, got {message.role!r}",
                )
        named = self.max_tokens_named
        request = self._generate_request(
            self.last_user_text(), max_tokens_cap if named is None else named
        )
        if self.logprobs:
            request.logprobs = True
            request.top_logprobs = self.top_logprobs or 0
        elif self.top_logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs set to true")
        return request

    @property
    def max_tokens_named(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def last_user_text(self) -> str:
        users = [message for message in self.messages if message.role == "user"]
        return users[-1].text() if users else self.messages[-1].text()

    def conversation(
        self, context_question: str | None
    ) -> tuple[inference_pb2.ConversationMessage, ...]:
        """The messages for the worker's chat template; context_question (the last user message
        with the chosen documents as context) replaces the last user message's text."""
        last_user = max(
            (i for i, said in enumerate(self.messages) if said.role == "user"), default=-1
        )
        return tuple(
            conversation_message(
                said.role,
                context_question
                if i == last_user and context_question is not None
                else said.text(),
            )
            for i, said in enumerate(self.messages)
        )


def parse(model: type[_Request], body: bytes) -> Any:
    """The request body as `model`, or InvalidArgument naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "body"
        if error["type"] == "json_invalid":
            raise InvalidArgument("body", "not valid JSON") from exc
        raise InvalidArgument(field, error["msg"]) from exc
