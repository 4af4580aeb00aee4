"""The router's per-request span (kind SERVER), following the GenAI semantic conventions.

Owns: one span per client request at the Router: its name (``"{operation} {model}"``), the
``gen_ai.*`` request/usage/response attributes, the ``specserve.*`` route decision, the first-token
event, error status, and the carrier handed to the engine through the Ray handle. A W3C
``traceparent`` in the client's gRPC metadata makes this span a child of the client's span.
Ignores: the routing policy itself and the engine-side spans (``engine_spans``).

The span is *not* made current: the router passes ``span.carrier()`` explicitly to the engine
handle, which keeps streaming handlers (async generators, closed from any context) free of
context attach/detach pitfalls.

Usage (router)::

    with request_span(model=name, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                      segment=req.segment, metadata=grpc_context.invocation_metadata()) as span:
        span.set_route(decision.path, decision.reason, inflight)
        ... await engine.generate.remote(request, span.carrier()) ...
        span.finish_from_output(final_output)
"""
from __future__ import annotations

import time
from typing import Any, Iterable

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from cluster.telemetry import semconv as sc
from cluster.telemetry import tracing
from cluster.telemetry.propagation import MetadataLike, extract_context, trace_carrier


def label(value: Any) -> str:
    """Enum or string -> the lower-case label used in attributes and metric labels."""
    if value is None:
        return ""
    v = getattr(value, "value", value)
    return str(v).lower()


class RequestSpan:
    """Live router span; use as a context manager (ends on exit, marks errors)."""

    __slots__ = ("span", "_start_ns", "_first_token_seen")

    def __init__(self, span: trace.Span, start_ns: int) -> None:
        self.span = span
        self._start_ns = start_ns
        self._first_token_seen = False

    @property
    def recording(self) -> bool:
        return self.span.is_recording()

    def carrier(self) -> dict[str, str]:
        """W3C headers naming this span as parent: pass to the engine handle call."""
        return trace_carrier(trace.set_span_in_context(self.span))

    def set_route(self, path: Any, reason: Any, inflight: int | None = None) -> None:
        attrs = {sc.ROUTE_PATH: label(path), sc.ROUTE_REASON: label(reason)}
        if inflight is not None:
            attrs[sc.INFLIGHT] = int(inflight)
        self.span.set_attributes(attrs)
        self.span.add_event(sc.EVENT_ROUTE, attrs)

    def first_token(self, ago_s: float = 0.0) -> None:
        """Call when the first output token reaches the router (TTFT as seen by the service);
        ``ago_s``: it was produced that long before now (a whole response arrives at the end)."""
        if self._first_token_seen:
            return
        self._first_token_seen = True
        now = max(self._start_ns, time.time_ns() - int(ago_s * 1e9))
        ttft_ms = (now - self._start_ns) / 1e6
        self.span.set_attribute(sc.TTFT_MS, ttft_ms)
        self.span.add_event(sc.EVENT_FIRST_TOKEN, {sc.TTFT_MS: ttft_ms}, timestamp=now)

    def set_usage(self, input_tokens: int, output_tokens: int) -> None:
        self.span.set_attributes({sc.GEN_AI_USAGE_INPUT_TOKENS: int(input_tokens),
                                  sc.GEN_AI_USAGE_OUTPUT_TOKENS: int(output_tokens)})

    def set_finish(self, reasons: Iterable[Any] | Any) -> None:
        if isinstance(reasons, (list, tuple)):
            values = [label(r) for r in reasons]
        else:
            values = [label(reasons)]
        self.span.set_attribute(sc.GEN_AI_RESPONSE_FINISH_REASONS, values)

    def finish_from_output(self, output: Any) -> None:
        """Usage, finish reason and speculation summary from the final ``RequestOutput``."""
        self.set_usage(output.num_prompt_tokens, output.num_output_tokens)
        if output.finish_reason is not None:
            self.set_finish(output.finish_reason)
        spec = getattr(output, "spec", None)
        if spec is not None and spec.draft_tokens:
            self.span.set_attributes({
                sc.SPEC_DRAFT_TOKENS: spec.draft_tokens,
                sc.SPEC_ACCEPTED_TOKENS: spec.accepted_tokens,
                sc.SPEC_ALPHA: round(spec.alpha, 4),
                sc.SPEC_ACCEPTANCE_RATE: round(spec.acceptance_rate, 4),
                sc.SPEC_MEAN_ACCEPTANCE_LENGTH: round(spec.mean_acceptance_length, 4),
            })
        if getattr(output, "error", None):
            self.set_error(output.error)

    def set_error(self, error: BaseException | str, error_type: str | None = None) -> None:
        if isinstance(error, BaseException):
            self.span.record_exception(error)
            etype = error_type or type(error).__name__
            desc = str(error)
        else:
            etype = error_type or "engine_error"
            desc = error
        self.span.set_attribute(sc.ERROR_TYPE, etype)
        self.span.set_status(Status(StatusCode.ERROR, desc[:256]))

    def __enter__(self) -> "RequestSpan":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, GeneratorExit):
            self.set_error(exc)
        self.span.end()


class _NoopRequestSpan:
    """Tracing off: every method is a no-op; ``carrier()`` is empty."""

    __slots__ = ()
    recording = False
    span = trace.INVALID_SPAN

    def carrier(self) -> dict[str, str]:
        return {}

    def set_route(self, path: Any, reason: Any, inflight: int | None = None) -> None: ...
    def first_token(self, ago_s: float = 0.0) -> None: ...
    def set_usage(self, input_tokens: int, output_tokens: int) -> None: ...
    def set_finish(self, reasons: Any) -> None: ...
    def finish_from_output(self, output: Any) -> None: ...
    def set_error(self, error: Any, error_type: str | None = None) -> None: ...

    def __enter__(self) -> "_NoopRequestSpan":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None


NOOP_REQUEST_SPAN = _NoopRequestSpan()


def request_span(*, model: str, operation: str = sc.OP_TEXT_COMPLETION, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, segment: str | None = None, request_id: str | None = None,
                 mode: Any = None, stream: bool = False,
                 metadata: MetadataLike = None) -> RequestSpan | _NoopRequestSpan:
    """Start the router span; ``metadata`` is the client's gRPC metadata (its ``traceparent``
    continues the client's trace). Returns a no-op object when tracing is off."""
    tracer = tracing._TRACER
    if tracer is None:
        return NOOP_REQUEST_SPAN
    attrs: dict[str, Any] = {
        sc.GEN_AI_OPERATION_NAME: operation,
        sc.GEN_AI_SYSTEM: sc.SYSTEM_NAME,
        sc.GEN_AI_PROVIDER_NAME: sc.SYSTEM_NAME,
        sc.GEN_AI_REQUEST_MODEL: model,
        sc.STREAM: bool(stream),
    }
    if max_tokens is not None:
        attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] = int(max_tokens)
    if temperature is not None:
        attrs[sc.GEN_AI_REQUEST_TEMPERATURE] = float(temperature)
    if top_p is not None:
        attrs[sc.GEN_AI_REQUEST_TOP_P] = float(top_p)
    if top_k:
        attrs[sc.GEN_AI_REQUEST_TOP_K] = int(top_k)
    if seed is not None:
        attrs[sc.GEN_AI_REQUEST_SEED] = int(seed)
    if segment:
        attrs[sc.SEGMENT] = segment
    if request_id:
        attrs[sc.REQUEST_ID] = request_id
        attrs[sc.GEN_AI_RESPONSE_ID] = request_id
    if mode is not None:
        attrs[sc.MODE] = label(mode)
    start_ns = time.time_ns()
    span = tracer.start_span(f"{operation} {model}", context=extract_context(metadata), kind=SpanKind.SERVER,
                             attributes=attrs, start_time=start_ns)
    return RequestSpan(span, start_ns)
