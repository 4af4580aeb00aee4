"""gRPC CLIENT/SERVER spans with W3C context in metadata, for KVSync (sync and asyncio gRPC).

Owns: interceptors that wrap unary-unary and unary-stream RPCs in spans named
``"{package.Service}/{Method}"`` with the RPC semantic-convention attributes
(``rpc.system=grpc``, ``rpc.service``, ``rpc.method``, ``rpc.grpc.status_code``), inject the span's
``traceparent`` into the outgoing metadata, and extract it on the server.

Policy ``require_parent=True`` (default): spans are made only inside an existing sampled trace — a
KVSync call runs every engine step, so it must never start traces of its own; the client then
parents under the context set by ``engine_spans.kvsync_context`` (and links the other requests of
the batch), the server under the incoming ``traceparent``. Tracing off: calls pass straight through.
Ignores: the KVSync protocol itself. The engine core never imports this module (grpc lives here).

Wiring::

    channel = grpc.intercept_channel(grpc.insecure_channel(addr), *client_interceptors())
    channel = grpc.aio.insecure_channel(addr, interceptors=aio_client_interceptors())
    server  = grpc.server(pool, interceptors=[TracingServerInterceptor()])
    server  = grpc.aio.server(interceptors=[AioTracingServerInterceptor()])
"""
from __future__ import annotations

import collections
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from cluster.telemetry import semconv as sc
from cluster.telemetry import tracing
from cluster.telemetry.propagation import extract_context, inject_context, span_links_from


def _split_method(method: str | bytes) -> tuple[str, str, str]:
    if isinstance(method, bytes):
        method = method.decode()
    full = method.lstrip("/")
    service, _, name = full.rpartition("/")
    return full, service, name


def _code_value(code: grpc.StatusCode | None) -> int:
    return code.value[0] if code is not None else grpc.StatusCode.UNKNOWN.value[0]


def _finish(span: trace.Span, code: grpc.StatusCode | None, error: BaseException | None = None) -> None:
    span.set_attribute(sc.RPC_GRPC_STATUS_CODE, _code_value(code))
    if error is not None:
        span.record_exception(error)
    if (code is not None and code != grpc.StatusCode.OK) or error is not None:
        span.set_status(Status(StatusCode.ERROR, code.name if code is not None else type(error).__name__))
    span.end()


def _start_client_span(method: str | bytes) -> trace.Span | None:
    tracer = tracing._TRACER
    if tracer is None:
        return None
    parent = trace.get_current_span()
    if not parent.is_recording():
        return None  # require_parent: no trace of our own for per-step RPCs
    full, service, name = _split_method(method)
    links = span_links_from()
    return tracer.start_span(full, kind=SpanKind.CLIENT, links=links, attributes={
        sc.RPC_SYSTEM: "grpc", sc.RPC_SERVICE: service, sc.RPC_METHOD: name,
        sc.KVSYNC_SAMPLED_REQUESTS: 1 + len(links)})


def _with_trace_metadata(metadata: Any, span: trace.Span) -> list[tuple[str, Any]]:
    pairs = [(k, v) for k, v in (metadata or ()) if k not in ("traceparent", "tracestate")]
    pairs.extend(inject_context(trace.set_span_in_context(span)))
    return pairs


# --- sync client -------------------------------------------------------------------------------
class _ClientCallDetails(
        collections.namedtuple("_ClientCallDetails",
                               ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


def _replace_details(details: grpc.ClientCallDetails, metadata: list) -> _ClientCallDetails:
    return _ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                              getattr(details, "wait_for_ready", None), getattr(details, "compression", None))


class TracingClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Sync-channel CLIENT spans."""

    def intercept_unary_unary(self, continuation, client_call_details, request):
        span = _start_client_span(client_call_details.method)
        if span is None:
            return continuation(client_call_details, request)
        details = _replace_details(client_call_details, _with_trace_metadata(client_call_details.metadata, span))
        try:
            outcome = continuation(details, request)
        except BaseException as e:  # noqa: BLE001 - re-raised
            _finish(span, None, e)
            raise
        # Blocking calls return a completed outcome; .future() calls complete later.
        outcome.add_done_callback(lambda call: _finish(span, call.code()))
        return outcome

    def intercept_unary_stream(self, continuation, client_call_details, request):
        span = _start_client_span(client_call_details.method)
        if span is None:
            return continuation(client_call_details, request)
        details = _replace_details(client_call_details, _with_trace_metadata(client_call_details.metadata, span))
        call = continuation(details, request)
        call.add_done_callback(lambda c: _finish(span, c.code()))
        return call


def client_interceptors() -> list[grpc.UnaryUnaryClientInterceptor]:
    return [TracingClientInterceptor()]


# --- asyncio client ----------------------------------------------------------------------------
def _aio_details(details: grpc.aio.ClientCallDetails, span: trace.Span) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*_with_trace_metadata(details.metadata, span))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class AioTracingUnaryUnaryInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        span = _start_client_span(client_call_details.method)
        if span is None:
            return await continuation(client_call_details, request)
        try:
            call = await continuation(_aio_details(client_call_details, span), request)
            code = await call.code()
        except BaseException as e:  # noqa: BLE001 - re-raised
            _finish(span, None, e)
            raise
        _finish(span, code)
        return call


class AioTracingUnaryStreamInterceptor(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        span = _start_client_span(client_call_details.method)
        if span is None:
            return await continuation(client_call_details, request)
        call = await continuation(_aio_details(client_call_details, span), request)
        call.add_done_callback(lambda c: _finish(span, c.code() if not c.cancelled() else grpc.StatusCode.CANCELLED))
        return call


def aio_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    return [AioTracingUnaryUnaryInterceptor(), AioTracingUnaryStreamInterceptor()]


# --- servers -------------------------------------------------------------------------------------
def _start_server_span(handler_call_details: grpc.HandlerCallDetails, context: Any) -> trace.Span | None:
    tracer = tracing._TRACER
    if tracer is None:
        return None
    parent = extract_context(handler_call_details.invocation_metadata)
    if parent is None or not trace.get_current_span(parent).get_span_context().trace_flags.sampled:
        return None
    full, service, name = _split_method(handler_call_details.method)
    attrs = {sc.RPC_SYSTEM: "grpc", sc.RPC_SERVICE: service, sc.RPC_METHOD: name}
    try:
        attrs[sc.NETWORK_PEER_ADDRESS] = context.peer()
    except Exception:  # noqa: BLE001 - peer is best effort
        pass
    return tracer.start_span(full, context=parent, kind=SpanKind.SERVER, attributes=attrs)


def _context_code(context: Any) -> grpc.StatusCode | None:
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc
        return None
    return code


def _handler_with(handler: grpc.RpcMethodHandler, **behaviour: Any) -> grpc.RpcMethodHandler:
    factory = grpc.unary_unary_rpc_method_handler if "unary_unary" in behaviour else grpc.unary_stream_rpc_method_handler
    fn = behaviour.get("unary_unary") or behaviour["unary_stream"]
    return factory(fn, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


class TracingServerInterceptor(grpc.ServerInterceptor):
    """Sync-server SERVER spans, current while the handler runs (handlers may ``tracing.add_event``)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or tracing._TRACER is None:
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary_unary(request, context):
                span = _start_server_span(handler_call_details, context)
                if span is None:
                    return inner(request, context)
                token = otel_context.attach(trace.set_span_in_context(span))
                try:
                    response = inner(request, context)
                except BaseException as e:  # noqa: BLE001 - re-raised
                    _finish(span, _context_code(context) or grpc.StatusCode.UNKNOWN, e)
                    raise
                finally:
                    otel_context.detach(token)
                _finish(span, _context_code(context) or grpc.StatusCode.OK)
                return response

            return _handler_with(handler, unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_s = handler.unary_stream

            def unary_stream(request, context):
                span = _start_server_span(handler_call_details, context)
                if span is None:
                    yield from inner_s(request, context)
                    return
                try:
                    with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                        yield from inner_s(request, context)
                except BaseException as e:  # noqa: BLE001 - re-raised
                    _finish(span, _context_code(context) or grpc.StatusCode.UNKNOWN, e)
                    raise
                _finish(span, _context_code(context) or grpc.StatusCode.OK)

            return _handler_with(handler, unary_stream=unary_stream)
        return handler


class AioTracingServerInterceptor(grpc.aio.ServerInterceptor):
    """asyncio-server SERVER spans (unary-unary and unary-stream handlers)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or tracing._TRACER is None:
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                span = _start_server_span(handler_call_details, context)
                if span is None:
                    return await inner(request, context)
                token = otel_context.attach(trace.set_span_in_context(span))
                try:
                    response = await inner(request, context)
                except BaseException as e:  # noqa: BLE001 - re-raised (AbortError included)
                    _finish(span, _context_code(context) or grpc.StatusCode.UNKNOWN, e)
                    raise
                finally:
                    otel_context.detach(token)
                _finish(span, _context_code(context) or grpc.StatusCode.OK)
                return response

            return _handler_with(handler, unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_s = handler.unary_stream

            async def unary_stream(request, context):
                span = _start_server_span(handler_call_details, context)
                if span is None:
                    async for item in inner_s(request, context):
                        yield item
                    return
                try:
                    with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                        async for item in inner_s(request, context):
                            yield item
                except BaseException as e:  # noqa: BLE001 - re-raised
                    _finish(span, _context_code(context) or grpc.StatusCode.UNKNOWN, e)
                    raise
                _finish(span, _context_code(context) or grpc.StatusCode.OK)

            return _handler_with(handler, unary_stream=unary_stream)
        return handler
