"""Sampling limits, declared once for the gateway and the worker, and the one check of a
SamplingParams against them (the gateway checks what a caller asked for before any work is
done; the worker checks what it is given, whoever sent it)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.validation import check_logprobs, check_range, check_stop
from tokenmesh.v1 import inference_pb2

MAX_TEMPERATURE = 2.0


class SamplingLimits(BaseModel):
    """The sampling fields' limits; past one, INVALID_ARGUMENT naming the field and the limit.
    A gateway's limits should be no wider than its workers' (a request it admits is then
    never refused by a worker)."""

    max_tokens_cap: int = Field(
        default=4096, ge=1, description="`max_tokens`: 1..this (every call shape)."
    )
    max_stop_sequences: int = Field(default=8, ge=0, description="`stop`: at most this many.")
    max_stop_sequence_bytes: int = Field(
        default=256, ge=1, description="Each of `stop`: 1..this many bytes (UTF-8)."
    )
    max_top_logprobs: int = Field(
        default=20,
        ge=0,
        description=(
            "`top_logprobs` (alternatives per token): 0..this; on a worker also vLLM's "
            "max_logprobs."
        ),
    )
    max_stream_interval: int = Field(
        default=64, ge=1, description="`stream_interval` (tokens per message): 0..this."
    )


def check_sampling(
    sampling: inference_pb2.SamplingParams, limits: SamplingLimits, prefix: str = ""
) -> None:
    """Every field of sampling within limits; prefix names where it sits in the caller's
    message ("" for the public API's flat fields, "sampling." for a worker's request)."""
    if not 1 <= sampling.max_tokens <= limits.max_tokens_cap:
        raise InvalidArgument(
            f"{prefix}max_tokens",
            f"must be in [1, {limits.max_tokens_cap}], got {sampling.max_tokens}",
        )
    if sampling.HasField("temperature"):
        check_range(f"{prefix}temperature", sampling.temperature, 0.0, MAX_TEMPERATURE)
    if sampling.HasField("top_p"):
        check_range(f"{prefix}top_p", sampling.top_p, 0.0, 1.0, low_open=True)
    if sampling.HasField("top_k") and (sampling.top_k == 0 or sampling.top_k < -1):
        raise InvalidArgument(f"{prefix}top_k", f"must be -1 (off) or >= 1, got {sampling.top_k}")
    check_stop(
        f"{prefix}stop", sampling.stop, limits.max_stop_sequences, limits.max_stop_sequence_bytes
    )
    check_logprobs(prefix, sampling.logprobs, sampling.top_logprobs, limits.max_top_logprobs)
    if not 0 <= sampling.stream_interval <= limits.max_stream_interval:
        raise InvalidArgument(
            f"{prefix}stream_interval",
            f"must be in [0, {limits.max_stream_interval}], got {sampling.stream_interval}",
        )
