"""Validation of worker requests (pure logic, no engine)."""

from __future__ import annotations

import pytest

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.requests import validate

LIMITS = WorkerSettings(max_tokens_cap=100, default_temperature=0.7)


def request(**sampling: object) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        prompt="hi", sampling=inference_pb2.SamplingParams(**{"max_tokens": 5, **sampling})
    )


def test_unset_optionals_take_defaults() -> None:
    spec = validate(request(), LIMITS)
    assert spec.temperature == 0.7 and spec.top_p == 1.0 and spec.top_k == -1
    assert spec.seed is None and spec.stop == ()


def test_explicit_zero_temperature_means_greedy_not_default() -> None:
    assert validate(request(temperature=0.0), LIMITS).temperature == 0.0


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
