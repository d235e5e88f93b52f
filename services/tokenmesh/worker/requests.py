"""Validation of InferenceRequest into an engine-ready GenerationSpec (transport-agnostic)."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2
from tokenmesh.worker.config import WorkerSettings

MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class GenerationSpec:
    """A validated generation request."""

    request_id: str
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool


def _check_range(field: str, value: float, low: float, high: float, low_open: bool) -> None:
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        bracket = "(" if low_open else "["
        raise InvalidArgument(field, f"must be in {bracket}{low:g}, {high:g}], got {value}")


def validate(request: inference_pb2.InferenceRequest, limits: WorkerSettings) -> GenerationSpec:
    """Check every field against the worker's limits; raise InvalidArgument naming the field."""
    if not request.prompt:
        raise InvalidArgument("prompt", "must not be empty")
    prompt_bytes = len(request.prompt.encode())
    if prompt_bytes > limits.max_prompt_bytes:
        raise InvalidArgument(
            "prompt", f"is {prompt_bytes} bytes, over the limit of {limits.max_prompt_bytes}"
        )
    sampling = request.sampling
    if not 1 <= sampling.max_tokens <= limits.max_tokens_cap:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"must be in [1, {limits.max_tokens_cap}], got {sampling.max_tokens}",
        )
    temperature = limits.default_temperature
    if sampling.HasField("temperature"):
        temperature = sampling.temperature
        _check_range("sampling.temperature", temperature, 0.0, MAX_TEMPERATURE, low_open=False)
    top_p = 1.0
    if sampling.HasField("top_p"):
        top_p = sampling.top_p
        _check_range("sampling.top_p", top_p, 0.0, 1.0, low_open=True)
    top_k = -1
    if sampling.HasField("top_k"):
        top_k = sampling.top_k
        if top_k == 0 or top_k < -1:
            raise InvalidArgument("sampling.top_k", f"must be -1 (off) or >= 1, got {top_k}")
    if len(sampling.stop) > limits.max_stop_sequences:
        raise InvalidArgument(
            "sampling.stop",
            f"has {len(sampling.stop)} sequences, over the limit of {limits.max_stop_sequences}",
        )
    for position, stop in enumerate(sampling.stop):
        size = len(stop.encode())
        if not stop or size > limits.max_stop_sequence_bytes:
            raise InvalidArgument(
                f"sampling.stop[{position}]",
                f"must be 1..{limits.max_stop_sequence_bytes} bytes, got {size}",
            )
    if len(request.request_id) > limits.max_request_id_chars:
        raise InvalidArgument(
            "request_id",
            f"is {len(request.request_id)} characters, over the limit of "
            f"{limits.max_request_id_chars}",
        )
    # The engine needs ids unique among in-flight requests; a caller's id may repeat, so it
    # gets a random suffix.
    suffix = uuid.uuid4().hex[:12]
    request_id = f"{request.request_id}-{suffix}" if request.request_id else suffix
    return GenerationSpec(
        request_id=request_id,
        prompt=request.prompt,
        max_tokens=sampling.max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        ignore_eos=sampling.ignore_eos,
    )
