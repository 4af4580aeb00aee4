"""Bearer-token check on the ``authorization`` gRPC metadata.

Owns: comparing ``authorization: Bearer <token>`` with the configured token in constant time
(``check_bearer`` for a handler that reads its own metadata; ``BearerAuthInterceptor`` for a
``grpc.Server`` that refuses every call without the token before any handler runs), the
metadata a client sends (``bearer_metadata``) and reading the token from the env var named by
``auth.token_env`` (``token_from_env``).
Ignores: TLS (channel credentials), which methods exist.
"""
from __future__ import annotations

import hmac
import os
from typing import Iterable

import grpc

from cluster.api.status import ServiceError


def check_bearer(metadata: Iterable[tuple[str, str]], token: str | None) -> None:
    """No-op when ``token`` is None (auth off); raises UNAUTHENTICATED otherwise on a bad header."""
    if token is None:
        return
    values = [v for k, v in metadata if k.lower() == "authorization"]
    if not values:
        raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")
    scheme, _, presented = values[0].partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), token.encode()):
        raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call (empty when auth is off)."""
    return () if token is None else (("authorization", f"Bearer {token}"),)


def token_from_env(token_env: str | None, who: str) -> str | None:
    """The bearer token from the env var ``token_env`` (None: auth off). A configured but empty
    variable is an error: silently running open would be the worst reading of the config."""
    if not token_env:
        return None
    token = os.environ.get(token_env) or None
    if token is None:
        raise ValueError(f"auth.token_env={token_env!r} is configured but that environment variable "
                         f"is empty in the {who} replica")
    return token


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call whose metadata lacks the bearer token; the
    handler never runs for them. ``token`` None: pass-through (auth off)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def intercept_service(self, continuation, handler_call_details):
        try:
            check_bearer(handler_call_details.invocation_metadata or (), self.token)
        except ServiceError as exc:
            code, message = exc.code, exc.message

            def deny(request, context):
                context.abort(code, message)

            return grpc.unary_unary_rpc_method_handler(deny)
        return continuation(handler_call_details)
