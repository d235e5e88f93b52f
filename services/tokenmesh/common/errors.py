"""Domain errors raised by service code; one interceptor maps them to gRPC status codes."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """An error the caller should see with a specific gRPC status code and message."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    """A request field is missing or out of range; the message names the field and the limit."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


class DependencyError(ServiceError):
    """A call to another service failed; carries that call's status code on to the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
