"""A stand-in KVSync service for telemetry tests: real gRPC (sync and asyncio) on 127.0.0.1, raw-bytes
messages, method names of the real service (``/specserve.v1.KVSync/Propose``).

Owns: just enough server behaviour to exercise the tracing interceptors — echo, a ``resync``
answer that adds a span event, and a failing method. Ignores: the KVSync protocol (protos/).
"""
from __future__ import annotations

from concurrent import futures

import grpc

from cluster.telemetry import tracing
from cluster.telemetry.grpc_interceptors import AioTracingServerInterceptor, TracingServerInterceptor

SERVICE = "specserve.v1.KVSync"
PROPOSE = f"/{SERVICE}/Propose"
FAIL = f"/{SERVICE}/Fail"
STREAM = f"/{SERVICE}/Watch"


def _identity(b: bytes) -> bytes:
    return b


class Recorder:
    """What the server saw: the metadata of every call."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []


def _propose(recorder: Recorder):
    def handler(request: bytes, context):
        recorder.metadata.append({k: v for k, v in context.invocation_metadata()})
        if request == b"resync":
            tracing.add_event("draft.resync", {"specserve.draft.reason": "prefix missing"})
        return b"ok:" + request
    return handler


def _fail(request: bytes, context):
    context.abort(grpc.StatusCode.UNAVAILABLE, "draft gone")


def _watch(request: bytes, context):
    for i in range(3):
        yield bytes([i])


def sync_server(recorder: Recorder) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[TracingServerInterceptor()])
    handlers = {
        "Propose": grpc.unary_unary_rpc_method_handler(_propose(recorder), _identity, _identity),
        "Fail": grpc.unary_unary_rpc_method_handler(_fail, _identity, _identity),
        "Watch": grpc.unary_stream_rpc_method_handler(_watch, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def aio_server(recorder: Recorder) -> tuple[grpc.aio.Server, int]:
    inner = _propose(recorder)

    async def propose(request: bytes, context):
        return inner(request, context)

    async def fail(request: bytes, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "draft gone")

    server = grpc.aio.server(interceptors=[AioTracingServerInterceptor()])
    handlers = {
        "Propose": grpc.unary_unary_rpc_method_handler(propose, _identity, _identity),
        "Fail": grpc.unary_unary_rpc_method_handler(fail, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    return server, port
