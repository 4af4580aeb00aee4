"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Owns: turning a ``ServiceError`` (raised by the rules both front ends share) into the status
(``cluster.api.status.http_status``, the one table beside the gRPC codes) and the body OpenAI
clients parse (the ``openai`` package raises ``BadRequestError``, ``AuthenticationError``,
``NotFoundError``, ``RateLimitError``, ``InternalServerError`` from the status), and the same body
as a Server-Sent Event for a failure after a stream has started (its status is already 200).
Ignores: which rule failed and why (the caller's ``ServiceError``).
"""
from __future__ import annotations

import grpc

from cluster.api.openai_responses import sse
from cluster.api.status import ServiceError, http_status

_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


def error_body(err: ServiceError) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) of ``err``."""
    status = http_status(err.code)
    code = "model_not_found" if err.code is grpc.StatusCode.NOT_FOUND and err.param == "model" \
        else err.code.name.lower()
    return status, _body(status, err.message, err.param, code)


def _body(status: int, message: str, param: str | None, code: str | None) -> dict:
    etype = _TYPE.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def http_error_body(status: int, message: str) -> dict:
    """An error the HTTP layer itself answers (unknown path 404, wrong method 405), same shape."""
    return _body(status, message, None, None)


def error_event(err: ServiceError) -> str:
    """A mid-stream failure as one SSE event (clients see it before ``data: [DONE]``)."""
    return sse(error_body(err)[1])
