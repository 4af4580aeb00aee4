"""Service errors with their gRPC status, and how engine-side failures travel to the Router.

Owns: ``ServiceError`` (a gRPC code + a message for the client), ``EngineFailure`` (a picklable
record an engine deployment yields instead of raising, so the Router maps it to a status without
depending on how Ray wraps remote exceptions), and what a client may be told of a failure: the
messages of the engine's own user-facing errors (bad input, queue full, engine gone) pass, while
any other exception becomes ``internal error (id ...)`` — its text (tracebacks, Ray actor ids, pids,
node IPs) is for the log, which the caller writes; and ``http_status``, the one table from a gRPC
code to the HTTP status the OpenAI-compatible front end answers with (one set of rules raises
``ServiceError``; each front end only translates its code). Ignores: setting the code on a context
(the Router), the OpenAI error body (``openai_errors``), logging.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from cluster.common.errors import EngineOverloadedError, EngineUnavailableError, InvalidRequestError


class FailureKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return {
            FailureKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
            FailureKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
            FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
            FailureKind.INTERNAL: grpc.StatusCode.INTERNAL,
        }[self]


class ServiceError(Exception):
    """``param``: the request field at fault, when one is (the OpenAI error body names it)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def __reduce__(self):  # picklable across Ray processes despite the multi-argument constructor
        return (ServiceError, (self.code, self.message, self.param))


@dataclass(slots=True, frozen=True)
class EngineFailure:
    kind: FailureKind
    message: str

    @classmethod
    def from_exception(cls, exc: BaseException, request_id: str) -> "EngineFailure":
        """Only the engine's user-facing errors keep their message; the caller logs ``exc``."""
        if isinstance(exc, InvalidRequestError):
            return cls(FailureKind.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, EngineOverloadedError):
            return cls(FailureKind.RESOURCE_EXHAUSTED, str(exc) or "engine queue is full")
        if isinstance(exc, EngineUnavailableError):
            return cls(FailureKind.UNAVAILABLE, ENGINE_GONE)
        return cls(FailureKind.INTERNAL, internal_message(request_id))

    def to_service_error(self) -> ServiceError:
        return ServiceError(self.kind.grpc_code, self.message)


ENGINE_GONE = "the engine serving this request stopped; retry (a replacement replica is started)"


# gRPC code -> HTTP status (the conventional mapping, as grpc-gateway uses); 500 for the rest.
_HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status of a ``ServiceError``'s gRPC code (INTERNAL, UNKNOWN, DATA_LOSS: 500)."""
    return _HTTP_STATUS.get(code, 500)


def internal_message(request_id: str) -> str:
    """What a client is told of an unexpected failure: the id to quote, the detail in the log."""
    return f"internal error (id {request_id})"


def internal_error(request_id: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INTERNAL, internal_message(request_id))


def invalid(message: str, param: str | None = None) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, param)
