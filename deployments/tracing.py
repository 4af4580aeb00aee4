"""OpenTelemetry tracer for the Router, from the ``telemetry`` knobs.

Owns: building a tracer that exports over OTLP/gRPC when ``otlp_endpoint`` is set, sampled at
``sampling_ratio``; a no-op tracer otherwise. Ignores: what gets traced (the Router sets the route
decision as span attributes).
"""
from __future__ import annotations

from deployments.app_config import TelemetryKnobs


def build_tracer(knobs: TelemetryKnobs):
    from opentelemetry import trace

    if not knobs.otlp_endpoint:
        return trace.NoOpTracer()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(resource=Resource.create({"service.name": knobs.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(knobs.sampling_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=knobs.otlp_endpoint,
                                                                    insecure=True)))
    return provider.get_tracer("specserve.router")
