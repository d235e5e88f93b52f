"""Domain errors raised by service code; one interceptor maps them to gRPC status codes."""

from __future__ import annotations

from typing import Any

import grpc


class ServiceError(Exception):
    """An error the caller should see with a specific gRPC status code and message."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        # Sent in the status trailers (e.g. retry-after-ms), after any the handler had set.
        self.trailing_metadata = trailing_metadata


class InvalidArgument(ServiceError):
    """A request field is missing or out of range; the message names the field and the limit."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


# Trailer telling a refused caller how long to back off, in whole milliseconds.
RETRY_AFTER_HEADER = "retry-after-ms"


class ResourceExhausted(ServiceError):
    """A limit was reached; the message names it and its value. With retry_after_ms, the
    trailers carry the back-off hint as retry-after-ms."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        hint = () if retry_after_ms is None else ((RETRY_AFTER_HEADER, str(retry_after_ms)),)
        super().__init__(message, hint)
        self.retry_after_ms = retry_after_ms


class Unauthenticated(ServiceError):
    """No valid credentials. One message for every cause, so callers learn nothing about
    which keys or tenants exist."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    """An authenticated caller asked for what its tenant may not use."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(ServiceError):
    """The service is not in a state to do this; the message says what would make it so."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


class DependencyError(ServiceError):
    """A call to another service failed; carries that call's status code on to the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# The HTTP status of each gRPC code, for the gateway's HTTP API (the mapping gRPC's own
# HTTP gateways use; CANCELLED as nginx's 499, a client gone).
HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for an HTTP status: what the gateway's OpenAI API answers and
    what the edge answers on its paths (meshconfig), one shape."""
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }
    return {
        "error": {
            "message": message,
            "type": kinds.get(status, "server_error" if status < 503 else "service_unavailable"),
            "param": param,
            "code": None,
        }
    }
