"""Service errors with their gRPC status, and how engine-side failures travel to the Router.

Owns: ``ServiceError`` (a gRPC code + a message for the client) and ``EngineFailure`` (a picklable
record an engine deployment yields instead of raising, so the Router maps it to a status without
depending on how Ray wraps remote exceptions). Ignores: setting the code on a context (the Router).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from cluster.engine.request import EngineOverloadedError, EngineUnavailableError, InvalidRequestError


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
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # picklable across Ray processes despite the two-argument constructor
        return (ServiceError, (self.code, self.message))


@dataclass(slots=True, frozen=True)
class EngineFailure:
    kind: FailureKind
    message: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> "EngineFailure":
        if isinstance(exc, InvalidRequestError):
            return cls(FailureKind.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, EngineOverloadedError):
            return cls(FailureKind.RESOURCE_EXHAUSTED, str(exc) or "engine queue is full")
        if isinstance(exc, EngineUnavailableError):
            return cls(FailureKind.UNAVAILABLE, str(exc))
        return cls(FailureKind.INTERNAL, f"{type(exc).__name__}: {exc}")

    def to_service_error(self) -> ServiceError:
        return ServiceError(self.kind.grpc_code, self.message)


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)
