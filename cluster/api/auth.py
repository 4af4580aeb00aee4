"""Bearer-token check on the ``authorization`` gRPC metadata.

Owns: comparing ``authorization: Bearer <token>`` with the configured token in constant time.
Ignores: where the token comes from (the Router reads the env var named by ``auth.token_env``).
"""
from __future__ import annotations

import hmac
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
