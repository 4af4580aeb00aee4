"""A real OTLP/gRPC trace receiver for tests: ``TraceService.Export`` on 127.0.0.1:<free port>.

Owns: decoding ``ExportTraceServiceRequest`` into flat ``ReceivedSpan`` records (hex ids, plain
attribute values, events, links, resource service name) and waiting until expected spans arrive.
Ignores: metrics/logs signals and partial-success semantics (every export is accepted).
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    links: list[tuple[str, str]]
    status_code: int  # 0 unset, 1 ok, 2 error
    service_name: str
    scope: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: "OtlpReceiver") -> None:
        self._sink = sink

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        spans = []
        for rs in request.resource_spans:
            service = _attrs(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=[(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        status_code=s.status.code, service_name=service, scope=ss.scope.name))
        self._sink._add(spans, context.invocation_metadata())
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Start with ``with OtlpReceiver() as r:``; point exporters at ``r.endpoint``."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self.exports = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _add(self, spans: list[ReceivedSpan], metadata: Any) -> None:
        with self._cond:
            self._spans.extend(spans)
            self.exports += 1
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted(s.name for s in self._spans)
                    raise TimeoutError(f"spans did not arrive in {timeout}s; have {names}")
                self._cond.wait(left)
            return list(self._spans)

    def start(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
