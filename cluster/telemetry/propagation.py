"""W3C Trace Context across process boundaries: gRPC metadata and plain dict carriers.

Owns: turning the current (or a given) span context into ``traceparent``/``tracestate`` pairs and
back. Two carrier shapes:

- gRPC metadata: a list of ``(key, value)`` pairs (``inject_context`` / ``extract_context``), used by
  the router for the client's ``traceparent`` and by the KVSync interceptors;
- a plain ``dict[str, str]`` (``trace_carrier``), the argument the router passes through a Ray
  ``DeploymentHandle`` call — Ray pickles it like any other argument, and the engine replica
  re-attaches it with ``extract_context`` (handles are not gRPC, so nothing propagates implicitly).

Also owns ``LINKS_KEY``: a context value carrying extra span contexts for a batched RPC (one
KVSync call serves many requests; the first sampled request is the parent, the others are links).
Ignores: span creation. Imports only opentelemetry (the engine core may import it).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Union

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cluster.telemetry import tracing

TraceCarrier = dict[str, str]
MetadataLike = Union[Mapping[str, str], Iterable[tuple[str, object]], None]

_PROPAGATOR = TraceContextTextMapPropagator()
_KEYS = ("traceparent", "tracestate")
LINKS_KEY = otel_context.create_key("specserve-span-links")
_EMPTY_CARRIER: TraceCarrier = {}


def trace_carrier(ctx: otel_context.Context | None = None) -> TraceCarrier:
    """W3C headers of ``ctx`` (default: the current context) as a fresh dict; ``{}`` when tracing is
    off or there is no valid span. Safe to pickle across a Ray handle call."""
    if tracing._TRACER is None:
        return {}
    carrier: TraceCarrier = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def inject_context(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """The same headers as gRPC metadata pairs (append them to a call's metadata)."""
    return list(trace_carrier(ctx).items())


def extract_context(carrier: MetadataLike) -> otel_context.Context | None:
    """Parent context from a dict carrier or gRPC metadata pairs (``grpc_context.invocation_metadata()``,
    keys case-insensitive, binary ``-bin`` entries ignored). None when tracing is off or no
    valid ``traceparent`` is present — callers then start a root span (subject to sampling)."""
    if tracing._TRACER is None or not carrier:
        return None
    if isinstance(carrier, Mapping):
        items = carrier.items()
    else:
        items = carrier
    headers: dict[str, str] = {}
    for key, value in items:
        k = key.lower() if isinstance(key, str) else key
        if k in _KEYS and isinstance(value, str):
            headers[k] = value
    if "traceparent" not in headers:
        return None
    ctx = _PROPAGATOR.extract(headers)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def span_links_from(ctx: otel_context.Context | None = None) -> list[trace.Link]:
    """Links stored under ``LINKS_KEY`` in ``ctx`` (default current) — read by the KVSync client."""
    spans = otel_context.get_value(LINKS_KEY, ctx)
    return [trace.Link(sc) for sc in spans] if spans else []
