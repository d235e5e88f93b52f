"""Sampling limits, declared once for the gateway and the worker, and the one check of a
SamplingParams against them (the gateway checks what a caller asked for before any work is
done; the worker checks what it is given, whoever sent it).

These are the mesh's own bounds (sizes and counts that keep a request's cost bounded). What a
value means to the engine (penalty ranges, token ids inside the vocabulary, a grammar that
compiles) is checked by vLLM's own validation on the worker (worker/engine_request.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from google.protobuf.message import Message
from pydantic import BaseModel, Field

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.validation import (
    check_count,
    check_logprobs,
    check_range,
    check_stop,
    check_text,
)
from tokenmesh.v1 import inference_pb2, token_pb2

MAX_TEMPERATURE = 2.0
# The float options whose ranges vLLM checks; NaN and infinities pass some of its checks.
FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


class SamplingLimits(BaseModel):
    """The sampling fields' limits; past one, INVALID_ARGUMENT naming the field and the limit.
    A gateway's limits should be no wider than its workers' (a request it admits is then
    never refused by a worker)."""

    max_tokens_cap: int = Field(
        default=4096, ge=1, description="`max_tokens`: 1..this (every call shape)."
    )
    max_model_name_bytes: int = Field(
        default=256, ge=1, description="`model` (the model or adapter a request names): 0..this."
    )
    max_stop_sequences: int = Field(default=8, ge=0, description="`stop`: at most this many.")
    max_stop_sequence_bytes: int = Field(
        default=256, ge=1, description="Each of `stop`: 1..this many bytes (UTF-8)."
    )
    max_top_logprobs: int = Field(
        default=20,
        ge=0,
        description=(
            "`top_logprobs` (alternatives per token) and `prompt_logprobs`: 0..this; on a "
            "worker also vLLM's max_logprobs."
        ),
    )
    max_stream_interval: int = Field(
        default=64, ge=1, description="`stream_interval` (tokens per message): 0..this."
    )
    max_choices: int = Field(
        default=16,
        ge=1,
        description=(
            "`n` (choices generated for one prompt): 1..this (0 means 1); a batch of prompts: "
            "prompts times `n` at most this."
        ),
    )
    max_token_ids: int = Field(
        default=1024,
        ge=0,
        description=(
            "`stop_token_ids`, `allowed_token_ids`, `logit_bias`: at most this many vocabulary "
            "ids each."
        ),
    )
    max_bad_words: int = Field(
        default=64, ge=0, description="`bad_words`: at most this many, each 1..256 bytes."
    )
    max_structured_output_bytes: int = Field(
        default=65536,
        ge=1,
        description=(
            "`structured_outputs` (a JSON schema, regular expression, grammar or choices): at "
            "most this many bytes (UTF-8) in all."
        ),
    )


class ToolLimits(BaseModel):
    """The limits of a conversation's tools (OpenAI's tools and tool_choice)."""

    max_tools: int = Field(default=128, ge=0, description="`tools`: at most this many functions.")
    max_tools_bytes: int = Field(
        default=262144,
        ge=1,
        description="`tools` and `tool_choice` as JSON: at most this many bytes together.",
    )


def check_tools(field: str, tools: inference_pb2.ToolCalling, limits: ToolLimits) -> None:
    """At most max_tools functions in at most max_tools_bytes of JSON (what each means is vLLM's
    request model's to check)."""
    size = len(tools.tools_json.encode()) + len(tools.tool_choice_json.encode())
    if size > limits.max_tools_bytes:
        raise InvalidArgument(field, f"is {size} bytes, over the limit of {limits.max_tools_bytes}")
    try:
        listed = json.loads(tools.tools_json) if tools.tools_json else []
    except ValueError as exc:
        raise InvalidArgument(f"{field}.tools_json", f"not valid JSON ({exc})") from exc
    if not isinstance(listed, list):
        raise InvalidArgument(f"{field}.tools_json", "must be a JSON array of tools")
    check_count(field, len(listed), limits.max_tools, "tools")


def check_sampling(
    sampling: inference_pb2.SamplingParams, limits: SamplingLimits, prefix: str = ""
) -> None:
    """Every field of sampling within limits; prefix names where it sits in the caller's
    message ("" for the public API's flat fields, "sampling." for a worker's request)."""
    # 0 with echo: the prompt alone, as vLLM's server answers it (its logprobs, scored).
    echo_only = sampling.echo and sampling.max_tokens == 0
    if not (1 <= sampling.max_tokens <= limits.max_tokens_cap or echo_only):
        raise InvalidArgument(
            f"{prefix}max_tokens",
            f"must be in [1, {limits.max_tokens_cap}] (0 with echo), got {sampling.max_tokens}",
        )
    if sampling.HasField("temperature"):
        check_range(f"{prefix}temperature", sampling.temperature, 0.0, MAX_TEMPERATURE)
    if sampling.HasField("top_p"):
        check_range(f"{prefix}top_p", sampling.top_p, 0.0, 1.0, low_open=True)
    if sampling.HasField("top_k") and sampling.top_k < -1:
        raise InvalidArgument(
            f"{prefix}top_k", f"must be -1 or 0 (off) or >= 1, got {sampling.top_k}"
        )
    for name in FLOAT_FIELDS:
        if sampling.HasField(name) and not math.isfinite(getattr(sampling, name)):
            raise InvalidArgument(
                f"{prefix}{name}", f"must be a finite number, got {getattr(sampling, name)}"
            )
    check_stop(
        f"{prefix}stop", sampling.stop, limits.max_stop_sequences, limits.max_stop_sequence_bytes
    )
    check_logprobs(prefix, sampling.logprobs, sampling.top_logprobs, limits.max_top_logprobs)
    if sampling.HasField("prompt_logprobs") and not (
        0 <= sampling.prompt_logprobs <= limits.max_top_logprobs
    ):
        raise InvalidArgument(
            f"{prefix}prompt_logprobs",
            f"must be in [0, {limits.max_top_logprobs}], got {sampling.prompt_logprobs}",
        )
    if not 0 <= sampling.stream_interval <= limits.max_stream_interval:
        raise InvalidArgument(
            f"{prefix}stream_interval",
            f"must be in [0, {limits.max_stream_interval}], got {sampling.stream_interval}",
        )
    if not 0 <= sampling.n <= limits.max_choices:
        raise InvalidArgument(
            f"{prefix}n", f"must be in [1, {limits.max_choices}] (0 means 1), got {sampling.n}"
        )
    if not 0 <= sampling.min_tokens <= sampling.max_tokens:
        raise InvalidArgument(
            f"{prefix}min_tokens",
            f"must be in [0, max_tokens={sampling.max_tokens}], got {sampling.min_tokens}",
        )
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        check_count(f"{prefix}{name}", len(getattr(sampling, name)), limits.max_token_ids, "ids")
    for token_id, bias in sampling.logit_bias.items():
        check_range(f"{prefix}logit_bias[{token_id}]", bias, -100.0, 100.0)
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        for token_id in getattr(sampling, name):
            if token_id < 0:
                raise InvalidArgument(f"{prefix}{name}", f"vocabulary ids are >= 0, got {token_id}")
    check_stop(f"{prefix}bad_words", sampling.bad_words, limits.max_bad_words, 256)
    if sampling.HasField("structured_outputs"):
        check_structured_outputs(
            f"{prefix}structured_outputs",
            sampling.structured_outputs,
            limits.max_structured_output_bytes,
        )


def check_structured_outputs(
    field: str, outputs: token_pb2.StructuredOutputs, max_bytes: int
) -> None:
    """A constraint, and at most max_bytes of its text in all (its meaning is vLLM's to
    check)."""
    if not (
        outputs.HasField("json")
        or outputs.HasField("regex")
        or outputs.choice
        or outputs.HasField("grammar")
        or outputs.json_object
    ):
        raise InvalidArgument(field, "needs one of json, regex, choice, grammar, json_object")
    texts = (outputs.json, outputs.regex, outputs.grammar)
    size = sum(len(text.encode()) for text in (*texts, *outputs.choice))
    if size > max_bytes:
        raise InvalidArgument(field, f"is {size} bytes, over the limit of {max_bytes}")


def copy_sampling(source: Message, target: inference_pb2.SamplingParams) -> None:
    """Copy every field of source (a public request) that SamplingParams has by the same name:
    the public API's sampling fields are named as the worker's, which are named as vLLM's."""
    names = source.DESCRIPTOR.fields_by_name
    for field in target.DESCRIPTOR.fields:
        if field.name not in names:
            continue
        value = getattr(source, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            getattr(target, field.name).update(value)
        elif field.is_repeated:
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            if source.HasField(field.name):
                getattr(target, field.name).CopyFrom(value)
        elif not field.has_presence or source.HasField(field.name):
            setattr(target, field.name, value)


def check_batch(
    prompts: Sequence[inference_pb2.PromptInput],
    n: int,
    limits: SamplingLimits,
    max_prompt_bytes: int,
    max_prompt_tokens: int | None = None,
) -> None:
    """A batch's prompts (OpenAI completions' list prompt): at most max_choices choices in
    all, each prompt a text of 1..max_prompt_bytes or ids (at most max_prompt_tokens of them,
    when known). Refusals name the caller's field, prompt[i]."""
    choices = len(prompts) * max(n, 1)
    if choices > limits.max_choices:
        raise InvalidArgument(
            "prompt",
            f"{len(prompts)} prompts of n={max(n, 1)} choices each are {choices} choices, "
            f"over the limit of {limits.max_choices}",
        )
    for position, item in enumerate(prompts):
        field = f"prompt[{position}]"
        if item.text and item.token_ids:
            raise InvalidArgument(field, "is a text or token ids, not both")
        if not item.token_ids:
            check_text(field, item.text, max_prompt_bytes)
        elif max_prompt_tokens is not None:
            check_count(field, len(item.token_ids), max_prompt_tokens, "tokens")
