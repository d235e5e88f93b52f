"""The engine's sampling parameters, made by vLLM's own code from the worker's request.

SamplingParams' fields are named as vLLM's OpenAI request fields (and the public APIs' as these),
so they go to vLLM's request model by name: vLLM's pydantic model validates them, its
`to_sampling_params` makes the engine's parameters with `vllm serve`'s defaults and rules, and
`SamplingParams.verify` checks them against the model (token ids inside the vocabulary, a
structured-output constraint that compiles). A field therefore means here exactly what it means
to `vllm serve`; errors name the field as the public APIs name it.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.json_format import MessageToDict
from pydantic import ValidationError
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2

# The worker's own fields (how many tokens, how they are streamed and reported); every other
# field of SamplingParams goes to vLLM's request model as it is.
MESH_FIELDS = frozenset(
    {
        "max_tokens",
        "max_tokens_within_context",
        "stream_interval",
        "logprobs",
        "top_logprobs",
        # Given to the engine's parameters after vLLM's model has made them (params below):
        # its model refuses prompt_logprobs on a stream, and every request here is one.
        "prompt_logprobs",
    }
)


# vLLM's request model of a request: a chat completion for a conversation, else a completion.
VllmRequest = CompletionRequest | ChatCompletionRequest


def engine_options(
    sampling: inference_pb2.SamplingParams,
    prompt: str | list[int] = "",
    messages: list[dict[str, Any]] | None = None,
    tools: inference_pb2.ToolCalling | None = None,
) -> VllmRequest:
    """vLLM's request model of this request, validated by vLLM: a chat completion of messages
    (and the tools they may call), or a completion of the prompt (the worker renders and
    tokenizes either itself; the model holds every sampling option as `vllm serve` takes
    it)."""
    fields: dict[str, Any] = MessageToDict(sampling, preserving_proto_field_name=True)
    if messages and tools is not None:
        fields.update(tool_fields(tools))
    for name in MESH_FIELDS:
        fields.pop(name, None)
    if sampling.stream_interval > 1:
        fields["stream_interval"] = sampling.stream_interval
    fields["stream"] = True  # outputs as deltas: the token stream
    model: type[VllmRequest]
    if messages:
        model, fields["messages"] = ChatCompletionRequest, messages
        if sampling.logprobs:
            fields["logprobs"], fields["top_logprobs"] = True, sampling.top_logprobs
    else:
        model, fields["prompt"] = CompletionRequest, prompt
        if sampling.logprobs:
            # A completion's logprobs: how many alternatives besides the sampled token.
            fields["logprobs"] = sampling.top_logprobs
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, VLLMValidationError) and cause.parameter:
            raise InvalidArgument(cause.parameter, str(cause)) from exc
        field = ".".join(str(part) for part in error["loc"]) or "sampling"
        raise InvalidArgument(field, error["msg"]) from exc
    except VLLMValidationError as exc:
        raise InvalidArgument(exc.parameter or "sampling", str(exc)) from exc


def tool_fields(tools: inference_pb2.ToolCalling) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls as OpenAI's JSON has them (the sizes were
    checked before; JSON that does not parse is the field's error)."""
    fields: dict[str, Any] = {}
    for name, text in (("tools", tools.tools_json), ("tool_choice", tools.tool_choice_json)):
        if text:
            try:
                fields[name] = json.loads(text)
            except ValueError as exc:
                raise InvalidArgument(name, f"not valid JSON ({exc})") from exc
    if tools.HasField("parallel_tool_calls"):
        fields["parallel_tool_calls"] = tools.parallel_tool_calls
    return fields


CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


def features(options: VllmRequest) -> list[str]:
    """The engine features a request uses, as the worker counts them."""
    used = []
    if isinstance(options, ChatCompletionRequest) and options.tools:
        choice = options.tool_choice
        used.append(f"tools_{choice if isinstance(choice, str) else 'named'}")
    constraint = options.structured_outputs
    if constraint is None:
        return used
    return used + [
        f"structured_outputs_{name}" for name in CONSTRAINTS if getattr(constraint, name)
    ]


class EngineSampling:
    """Makes a request's engine parameters and checks them against the loaded model, as vLLM's
    server does before it adds a request."""

    def __init__(self, llm: Any, defaults: dict[str, Any]) -> None:
        self._model_config = llm.model_config
        self._structured_outputs_config = llm.vllm_config.structured_outputs_config
        # An engine with LoRA on fails a batch step that computes prompt logprobs (its
        # logits' LoRA layer is indexed by the sampled sequences, not the prompt's tokens:
        # vllm-project/vllm#16668, #29955), and dies with every stream on it.
        self._lora = getattr(llm.vllm_config, "lora_config", None) is not None
        self._tokenizer = llm.renderer.tokenizer
        # Where a request leaves a field unset (vLLM's default_sampling_params).
        self._defaults = defaults

    def params(
        self, options: VllmRequest, max_tokens: int, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """prompt_logprobs: the request's own (None: vLLM's rule, with echo and logprobs the
        completion's logprobs)."""
        try:
            params = options.to_sampling_params(max_tokens, self._defaults)
            if prompt_logprobs is not None:
                params.prompt_logprobs = prompt_logprobs
            if self._lora and params.prompt_logprobs is not None:
                raise InvalidArgument(
                    "prompt_logprobs" if prompt_logprobs is not None else "echo",
                    "prompt logprobs are not available on a worker that serves LoRA adapters "
                    "(vLLM's engine fails them: vllm-project/vllm#16668)",
                )
            # vLLM checks these again as it adds the request, but there a constraint that does
            # not compile (a plain ValueError) becomes an EngineGenerateError, an internal
            # error; checked here first, every refusal is the caller's, naming the field.
            params.verify(
                self._model_config, None, self._structured_outputs_config, self._tokenizer
            )
        except (VLLMValidationError, ValueError) as exc:
            raise InvalidArgument(_field(exc, options), str(exc)) from exc
        return params


def _field(error: Exception, options: VllmRequest) -> str:
    """The field a vLLM validation error is about: the one it names, else the field its
    message begins with (SamplingParams' own checks: "min_p must be in [0, 1], got 3.0"), else
    the structured-output constraint (vLLM's backends report one that does not compile as a
    plain ValueError with the compiler's message)."""
    if isinstance(error, VLLMValidationError) and error.parameter:
        return error.parameter
    words = str(error).split(maxsplit=1)
    first = words[0].strip("`'\":,") if words else ""
    if first in inference_pb2.SamplingParams.DESCRIPTOR.fields_by_name:
        return first
    return "structured_outputs" if options.structured_outputs else "sampling"
