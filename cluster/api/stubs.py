"""Accessors for the generated gRPC modules, generating them on first use if missing.

Owns: importing ``cluster.api.gen.specserve.v1.*`` (after ``protogen.generate`` when the stubs are
absent, so ``serve deploy`` on a fresh install works) and the servicer-registration functions named
in ``grpc_options.grpc_servicer_functions`` of the Serve config. Ignores: what the services do.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from cluster.api import protogen

_GEN = "cluster.api.gen.specserve.v1"


def _load(name: str) -> ModuleType:
    if not protogen.stubs_present():
        protogen.generate(force=False)
        importlib.invalidate_caches()
    return importlib.import_module(f"{_GEN}.{name}")


def generation_pb2() -> ModuleType:
    return _load("generation_pb2")


def generation_grpc() -> ModuleType:
    return _load("generation_pb2_grpc")


def kvsync_pb2() -> ModuleType:
    return _load("kvsync_pb2")


def kvsync_grpc() -> ModuleType:
    return _load("kvsync_pb2_grpc")


def add_GenerationServicer_to_server(servicer, server) -> None:  # noqa: N802 (gRPC naming)
    """For Serve's ``grpc_servicer_functions``: registers the Generation service."""
    generation_grpc().add_GenerationServicer_to_server(servicer, server)


def add_HealthServicer_to_server(servicer, server) -> None:  # noqa: N802
    """For Serve's ``grpc_servicer_functions``: registers grpc.health.v1 (answered by the Router)."""
    from grpc_health.v1 import health_pb2_grpc

    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


GRPC_SERVICER_FUNCTIONS = [
    "cluster.api.stubs.add_GenerationServicer_to_server",
    "cluster.api.stubs.add_HealthServicer_to_server",
]
