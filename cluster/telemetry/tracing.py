"""The per-process tracer: TracerProvider + ParentBased(TraceIdRatioBased) + BatchSpanProcessor
+ OTLP/gRPC exporter, configured once per process and free when off.

Owns: building, replacing and shutting down this process's provider; the module-level tracer the
other telemetry modules read. Ignores: what spans exist (``request_span``, ``engine_spans``,
``grpc_interceptors``) and how settings are resolved (``config``).

Fast path: every helper in this package first reads the module global ``_TRACER``; when tracing is
off it is ``None`` and helpers return shared no-op objects — one global read and one comparison,
no allocation, no OpenTelemetry call.

We keep our own provider instead of installing the OpenTelemetry global one: the global can be set
only once per process, while a replica (and the tests) may reconfigure. Export is asynchronous
(BatchSpanProcessor, tuned by the standard ``OTEL_BSP_*`` variables); spans still buffered when a
replica is killed hard are lost — ``shutdown_tracing()`` in a deployment's shutdown path flushes them.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from cluster.telemetry.config import TelemetryConfig

INSTRUMENTATION_NAME = "specserve"

_LOCK = threading.Lock()
_CONFIG: TelemetryConfig | None = None
_PROVIDER: TracerProvider | None = None
_TRACER: trace.Tracer | None = None  # None <=> tracing off: the fast-path flag
_FLUSH_HOOKS: list = []  # callables(timeout_s) -> bool run before a flush (deferred emitters)


def register_flush_hook(hook) -> None:
    """Run ``hook(timeout_s)`` before every flush/shutdown (``engine_spans`` drains its emitter)."""
    _FLUSH_HOOKS.append(hook)


def _run_flush_hooks(timeout_s: float) -> bool:
    return all([hook(timeout_s) for hook in list(_FLUSH_HOOKS)])


def configure_tracing(cfg: TelemetryConfig | None = None, *, exporter: SpanExporter | None = None) -> bool:
    """Set up tracing for this process; returns whether tracing is on.

    Idempotent: calling again with an equal config is a no-op (every deployment's ``__init__`` may
    call it). A different config flushes and replaces the previous provider. ``cfg=None`` resolves
    from the environment alone. ``exporter`` replaces the OTLP exporter (tests, debugging).
    """
    global _CONFIG, _PROVIDER, _TRACER
    cfg = TelemetryConfig.resolve(None) if cfg is None else cfg
    with _LOCK:
        if _CONFIG == cfg and exporter is None and (_PROVIDER is not None or not cfg.enabled):
            return _TRACER is not None
        _run_flush_hooks(5.0)
        _shutdown_locked()
        _CONFIG = cfg
        if not cfg.enabled:
            return False
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=cfg.use_insecure)
        root = TraceIdRatioBased(cfg.sampling_ratio)
        sampler = ParentBased(root) if cfg.parent_based else root
        resource = Resource.create({
            "service.name": cfg.service_name,
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
        })
        provider = TracerProvider(sampler=sampler, resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        _PROVIDER = provider
        _TRACER = provider.get_tracer(INSTRUMENTATION_NAME)
        return True


def configure_from_section(section: Mapping[str, Any] | Any | None) -> bool:
    """One-line hook for deployments: resolve the serve-config ``telemetry`` section + env, configure."""
    return configure_tracing(TelemetryConfig.resolve(section))


def tracing_enabled() -> bool:
    return _TRACER is not None


def get_tracer() -> trace.Tracer | None:
    """The process tracer, or None when tracing is off (callers take their no-op path)."""
    return _TRACER


def current_config() -> TelemetryConfig | None:
    return _CONFIG


def force_flush(timeout_millis: int = 5000) -> bool:
    """Export buffered spans now (tests; before a replica exits)."""
    drained = _run_flush_hooks(timeout_millis / 1000)
    provider = _PROVIDER
    return (provider.force_flush(timeout_millis) if provider is not None else True) and drained


def shutdown_tracing() -> None:
    """Flush and stop exporting; tracing is off afterwards until configured again."""
    global _CONFIG
    _run_flush_hooks(5.0)
    with _LOCK:
        _shutdown_locked()
        _CONFIG = None


def _shutdown_locked() -> None:
    global _PROVIDER, _TRACER
    provider, _PROVIDER, _TRACER = _PROVIDER, None, None
    if provider is not None:
        provider.shutdown()


def add_event(name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """Add an event to the current span (e.g. the KVSync SERVER span on a resync); free when off."""
    if _TRACER is None:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, attributes=dict(attributes) if attributes else None)
