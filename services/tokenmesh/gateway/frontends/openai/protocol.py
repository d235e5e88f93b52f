"""OpenAI completions and chat completions: request models, and the requests they become."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import ParseDict, ParseError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.gateway.core.prompts import PromptBatch
from tokenmesh.gateway.core.prompts import message as conversation_message
from tokenmesh.v1 import inference_pb2, llm_pb2

# OpenAI's default for /v1/completions when max_tokens is left out.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ROLES = ("system", "user", "assistant", "tool")
# What the protobuf fields these numbers go into hold: past it, a request is refused naming the
# field (400), never failed as an internal error.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchema(BaseModel):
    """OpenAI's response_format.json_schema; strict is accepted (the schema always binds)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    # JSON text, as OpenAI's API has it.
    arguments: str


class ToolCall(BaseModel):
    """A call an assistant message made (a conversation sent back with the calls' results)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    # A field of a message this API does not take is refused by name.
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant's calls; a tool message's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def size(self) -> int:
        """Bytes of content and call arguments."""
        return len(self.text().encode()) + sum(
            len(call.function.arguments.encode()) for call in self.tool_calls or ()
        )


# The request fields that are sampling options, taken as they are: GenerateRequest's fields that
# the worker's SamplingParams has by the same name (named as vLLM's), but those the models below
# read themselves. A sampling field added to both protos is taken with no change here.
SAMPLING_FIELDS = frozenset(
    set(llm_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    & set(inference_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
) - {"max_tokens", "stop", "logprobs", "top_logprobs", "structured_outputs", "n"}


class _Request(BaseModel):
    """The fields both endpoints share. Every sampling option of vLLM's OpenAI server that the
    engine honours is taken by its name (SAMPLING_FIELDS, structured_outputs); response_format
    becomes structured outputs as vLLM's server makes it. A field this API does not take is
    refused by name (400), never ignored; `user` is OpenAI's end-user id, which changes
    nothing."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Int32 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int32 = 1
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's own extension: json (a schema object or its text), regex, choice, grammar,
    # json_object.
    structured_outputs: dict[str, Any] | None = None
    # tokenmesh's extras: context documents (reranked, best top_k_documents kept) and
    # generating to max_tokens whatever the model would end with.
    documents: list[str] = Field(default_factory=list)
    top_k_documents: Int32 = 0

    def unsupported(self) -> None:
        for name in self.model_extra or {}:
            if name not in SAMPLING_FIELDS:
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
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            n=self.n,
        )
        if self.n < 1:
            raise InvalidArgument("n", f"must be at least 1, got {self.n}")
        for name, value in (self.model_extra or {}).items():
            if value is not None:
                _parse_field(name, value, request)
        constraint = self._structured_outputs()
        if constraint is not None:
            _parse_field("structured_outputs", constraint, request)
        return request

    def _structured_outputs(self) -> dict[str, Any] | None:
        """structured_outputs as GenerateRequest holds it; response_format as vLLM's server
        turns it into structured outputs (json_object, or json_schema's schema as json)."""
        constraint = self.structured_outputs
        if constraint is not None and isinstance(constraint.get("json"), dict | list):
            constraint = {**constraint, "json": json.dumps(constraint["json"])}
        response = self.response_format
        if response is None or response.type == "text":
            return constraint
        if constraint is not None:
            raise InvalidArgument(
                "response_format", "set either response_format or structured_outputs, not both"
            )
        if response.type == "json_object":
            return {"json_object": True}
        if response.json_schema is None:
            raise InvalidArgument(
                "response_format.json_schema", 'required when "type" is "json_schema"'
            )
        return {"json": json.dumps(response.json_schema.schema_)}


def _parse_field(name: str, value: Any, request: llm_pb2.GenerateRequest) -> None:
    """One JSON field into the request's field of that name; a value of the wrong type or out
    of its range is refused naming the field, what it takes and the parser's word on it."""
    try:
        ParseDict({name: value}, request)
    except ParseError as exc:
        detail = str(exc).removeprefix(f"Failed to parse {name} field: ").rstrip(".")
        if "out of range" in detail:
            raise InvalidArgument(name, detail) from exc
        expected = _expected(request.DESCRIPTOR.fields_by_name[name])
        raise InvalidArgument(name, f"must be {expected} ({detail})") from exc


_KINDS = {
    FieldDescriptor.TYPE_INT32: "integer",
    FieldDescriptor.TYPE_INT64: "integer",
    FieldDescriptor.TYPE_FLOAT: "number",
    FieldDescriptor.TYPE_DOUBLE: "number",
    FieldDescriptor.TYPE_BOOL: "boolean",
    FieldDescriptor.TYPE_STRING: "string",
}


def _expected(field: FieldDescriptor) -> str:
    """What a field takes, in JSON's words."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        return (
            f"an object of {_KINDS.get(key.type, 'key')} keys to {_KINDS.get(value.type, 'value')}s"
        )
    kind = "object" if field.message_type is not None else _KINDS.get(field.type, "value")
    if field.is_repeated:
        return f"a list of {kind}s"
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


class CompletionRequest(_Request):
    # A text, or as OpenAI's and vLLM's servers take it: several texts, one prompt's token ids,
    # or several prompts' (a batch).
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's completions take the number of alternatives to return (0..5).
    logprobs: Int32 | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One of the four shapes, or a refusal naming them (not one per shape tried)."""
        if isinstance(value, str) or (
            isinstance(value, list)
            and (
                all(isinstance(item, str) for item in value)
                or all(_is_ids(item) for item in value)
                or all(isinstance(item, list) and all(_is_ids(i) for i in item) for item in value)
            )
        ):
            return value
        raise PydanticCustomError(
            "prompt_shape",
            "must be a text, a list of texts, a list of token ids or a list of lists of them",
        )

    def batch(self) -> PromptBatch | None:
        """The prompts of a batch or one of token ids (None: one text prompt, a list of one
        text included, which is the same request)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return None
        if not prompt:
            raise InvalidArgument("prompt", "must not be empty")
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return None
        if isinstance(prompt[0], int):
            return PromptBatch(token_ids=tuple(_token_ids("prompt", prompt).token_ids))
        items = []
        for position, item in enumerate(prompt):
            field = f"prompt[{position}]"
            if not item:
                raise InvalidArgument(field, "must not be empty")
            if isinstance(item, str):
                items.append(inference_pb2.PromptInput(text=item))
            else:
                items.append(_token_ids(field, item))  # type: ignore[arg-type]
        return PromptBatch(tuple(items))

    def text(self) -> str:
        """The one text prompt ("" for a batch or token ids)."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) == 1 and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return ""

    def generate_request(self, max_tokens_cap: int) -> llm_pb2.GenerateRequest:
        self.unsupported()
        request = self._generate_request(
            self.text(),
            COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens,
        )
        if self.logprobs is not None:
            request.logprobs = True
            request.top_logprobs = self.logprobs
        return request


def _is_ids(value: Any) -> bool:
    return type(value) is int  # a JSON integer (not true or false)


def _token_ids(field: str, ids: list[int]) -> inference_pb2.PromptInput:
    """A prompt of vocabulary ids (whether each is inside the vocabulary is the worker's to
    check)."""
    for position, token_id in enumerate(ids):
        if not 0 <= token_id < 2**31:
            raise InvalidArgument(
                f"{field}[{position}]", f"must be a vocabulary id (>= 0), got {token_id}"
            )
    return inference_pb2.PromptInput(token_ids=ids)


class ChatCompletionRequest(_Request):
    messages: list[Message]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    # OpenAI's function calling: what each tool is and whether (and which) to call is vLLM's
    # request model's to check on the worker, as `vllm serve` checks it.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_calling(self) -> inference_pb2.ToolCalling | None:
        """tools, tool_choice and parallel_tool_calls for the worker (None: no tools)."""
        if not self.tools:
            return None
        calling = inference_pb2.ToolCalling(tools_json=json.dumps(self.tools))
        if self.tool_choice is not None:
            calling.tool_choice_json = json.dumps(self.tool_choice)
        if self.parallel_tool_calls is not None:
            calling.parallel_tool_calls = self.parallel_tool_calls
        return calling

    def generate_request(self, max_tokens_cap: int) -> llm_pb2.GenerateRequest:
        """The request as a Generate of its last user message (what documents are ranked
        against); the conversation itself goes to the worker as messages()."""
        self.unsupported()
        if not self.messages:
            raise InvalidArgument("messages", "at least one message is required")
        if not self.tools and self.tool_choice not in (None, "none"):
            raise InvalidArgument("tool_choice", "needs tools: there is nothing to call")
        if (self.model_extra or {}).get("echo"):
            raise InvalidArgument("echo", "echoes a prompt: send it to /v1/completions")
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
        messages = []
        for i, said in enumerate(self.messages):
            replaced = i == last_user and context_question is not None
            message = conversation_message(
                said.role, context_question if replaced and context_question else said.text()
            )
            for index, call in enumerate(said.tool_calls or ()):
                message.tool_calls.add(
                    index=index,
                    id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                )
            message.tool_call_id = said.tool_call_id or ""
            message.name = said.name or ""
            messages.append(message)
        return tuple(messages)


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
