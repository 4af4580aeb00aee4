"""Observability for specserve: OpenTelemetry traces (OTLP -> Jaeger) and Prometheus metrics.

Modules, one concept each:

- ``config``            TelemetryConfig: serve-config section + ``OTEL_*`` environment, resolved once.
- ``semconv``           attribute and span names (GenAI semantic conventions + ``specserve.*``).
- ``tracing``           the per-process TracerProvider (idempotent ``configure_tracing``), no-op when off.
- ``propagation``       W3C ``traceparent`` in/out of gRPC metadata and plain dict carriers
                        (the form that crosses Ray DeploymentHandle calls).
- ``request_span``      the router's per-request span.
- ``engine_spans``      the engine replica's per-request recorder (queue wait, prefill, decode,
                        speculative summary with per-step events, fallback/resync events).
- ``grpc_interceptors`` CLIENT/SERVER spans for KVSync (the only module here importing grpc).
- ``metrics_backend``   Ray Serve metrics inside Ray, prometheus_client elsewhere.
- ``metrics``           the ``specserve_*`` metric set and its recording helpers.

This ``__init__`` imports nothing so that the engine core can import ``engine_spans`` (which
imports only ``opentelemetry``) without pulling grpc, Ray or prometheus_client.
"""
