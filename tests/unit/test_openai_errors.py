"""The OpenAI API's errors: statuses, OpenAI's error object, back-off headers."""

from __future__ import annotations

import grpc
import pytest

from tokenmesh.common.errors import (
    DependencyError,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
)
from tokenmesh.common.openai_answers import error_response


def test_a_bad_field_is_400_naming_it() -> None:
    status, body, headers = error_response(InvalidArgument("max_tokens", "must be in [1, 8]"))
    assert status == 400 and headers == []
    assert body["error"]["param"] == "max_tokens"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "max_tokens: must be in [1, 8]"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            "messages[1].tool_call_id: a tool message needs the call's id",
            "messages[1].tool_call_id",
        ),
        ("tools.0.function.name: Field required", "tools.0.function.name"),
        ("the request is bad", None),
    ],
)
def test_a_refusal_passed_on_names_its_field_as_the_param(message: str, param: str | None) -> None:
    """A worker's refusal reaches the OpenAI answer as its status and message only."""
    status, body, _ = error_response(DependencyError(grpc.StatusCode.INVALID_ARGUMENT, message))
    assert status == 400 and body["error"]["param"] == param
    assert body["error"]["message"] == message


def test_a_tenant_over_its_limit_is_429_with_its_back_off() -> None:
    status, body, headers = error_response(ResourceExhausted("over 2 streams", 1500))
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert dict(headers) == {b"retry-after": b"2", b"retry-after-ms": b"1500"}


def test_full_workers_are_503_with_a_back_off_not_the_tenants_429() -> None:
    overloaded = DependencyError(grpc.StatusCode.RESOURCE_EXHAUSTED, "worker overloaded: ...")
    status, body, headers = error_response(overloaded)
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert dict(headers)[b"retry-after"] == b"1"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (DependencyError(grpc.StatusCode.UNAVAILABLE, "worker: no healthy upstream"), 503),
        (DependencyError(grpc.StatusCode.DEADLINE_EXCEEDED, "worker: deadline"), 504),
        (Unauthenticated("invalid or missing API key"), 401),
    ],
)
def test_other_codes_keep_grpcs_http_mapping(error: Exception, status: int) -> None:
    assert error_response(error)[0] == status


def test_an_unexpected_error_is_500_without_its_details() -> None:
    status, body, _ = error_response(RuntimeError("secret stack detail"))
    assert status == 500
    assert body["error"]["message"] == "internal error"
    assert "secret" not in str(body)
