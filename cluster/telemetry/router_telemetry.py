"""Everything the Router records about one request, behind four calls.

Owns: pairing the router span (``request_span``) with the request metrics (``metrics``) so the
Router's request path needs only: open (before validation, so rejected requests are traced too),
``routed`` (after the decision), ``output`` (every delta: first-token time, final usage), and close
(ends the span, records metrics for finished requests). TTFT and end-to-end latency are measured
here, on the Router's clock, i.e. what the client sees minus the network.
Ignores: the routing policy, gRPC status mapping.

Usage::

    with RequestTelemetry(self.metrics, model=self.app.model,
                          metadata=grpc_context.invocation_metadata(), stream=False) as tel:
        vreq, decision = self.admit(request, grpc_context)       # ServiceError -> span error
        tel.routed(vreq, decision, inflight=self.spec_in_flight)
        async for out in self.forward(vreq, decision, tel.carrier()):
            tel.output(out)
"""
from __future__ import annotations

import time
from typing import Any

from cluster.telemetry import semconv as sc
from cluster.telemetry.metrics import SpecserveMetrics
from cluster.telemetry.propagation import MetadataLike
from cluster.telemetry.request_span import label, request_span

# the client's request_id metadata: a label only (specserve.request_id is the server's own id)
REQUEST_LABEL = "specserve.request_label"
API_GRPC, API_OPENAI = "grpc", "openai"  # the front end a request came through (span + metric label)


class RequestTelemetry:
    __slots__ = ("_metrics", "_span", "_t0", "_ttft", "_final", "_path", "_reason", "_segment", "_error",
                 "_api")

    def __init__(self, metrics: SpecserveMetrics | None, *, model: str, metadata: MetadataLike = None,
                 stream: bool = False, operation: str = sc.OP_TEXT_COMPLETION, api: str = API_GRPC) -> None:
        self._metrics = metrics
        self._t0 = time.perf_counter()
        self._span = request_span(model=model, operation=operation, metadata=metadata, stream=stream)
        self._ttft: float | None = None
        self._final: Any = None
        self._path: Any = None
        self._reason: Any = None
        self._segment: str | None = None
        self._error: str | None = None
        self._api = api
        self._span.span.set_attribute(sc.API, api)  # a no-op span when tracing is off

    def set_stream(self, stream: bool) -> None:
        """The HTTP front end learns ``stream`` from the body, after the span opened."""
        self._span.span.set_attribute(sc.STREAM, bool(stream))

    @property
    def span(self):
        return self._span

    def routed(self, vreq: Any, decision: Any, inflight: int | None = None) -> None:
        """After validation and the route decision (``ValidatedRequest``, ``RouteDecision``)."""
        self._path, self._reason, self._segment = decision.path, decision.reason, vreq.segment
        span = self._span
        if span.recording:
            p = vreq.params
            attrs = {sc.GEN_AI_REQUEST_MAX_TOKENS: int(p.max_tokens), sc.GEN_AI_REQUEST_TEMPERATURE: float(p.temperature),
                     sc.GEN_AI_REQUEST_TOP_P: float(p.top_p), sc.SEGMENT: vreq.segment,
                     sc.REQUEST_ID: vreq.request_id, sc.GEN_AI_RESPONSE_ID: vreq.request_id,
                     sc.MODE: label(vreq.mode)}
            if p.top_k:
                attrs[sc.GEN_AI_REQUEST_TOP_K] = int(p.top_k)
            if p.seed is not None:
                attrs[sc.GEN_AI_REQUEST_SEED] = int(p.seed)
            if getattr(vreq, "label", ""):
                attrs[REQUEST_LABEL] = vreq.label
            if getattr(vreq, "draft_scope", ""):
                attrs[sc.DRAFT_SCOPE] = vreq.draft_scope
            prompt = getattr(vreq, "prompt", None)
            if getattr(prompt, "messages", None) is not None:
                attrs[sc.GEN_AI_OPERATION_NAME] = sc.OP_CHAT
            span.span.set_attributes(attrs)
            span.set_route(decision.path, decision.reason, inflight)

    def carrier(self) -> dict[str, str]:
        """Pass to the engine handle call (trace context across the Ray handle)."""
        return self._span.carrier()

    def output(self, out: Any, closes: bool = True) -> None:
        """Every ``RequestOutput`` delta the Router forwards. A whole response (every token in one
        final output, unary ``Generate``) dates its first token by the engine's own timings:
        now minus the engine's time from first token to finish. ``closes=False``: a finished output
        that does not finish the request (one of its several choices; the summary follows)."""
        if self._ttft is None and out.new_token_ids:
            ago = 0.0
            if out.finished and out.first_token_time is not None and out.finish_time is not None:
                ago = max(0.0, out.finish_time - out.first_token_time)
            self._ttft = max(0.0, time.perf_counter() - self._t0 - ago)
            self._span.first_token(ago_s=ago)
        if out.finished and closes:
            self._final = out
            self._span.finish_from_output(out)

    def error(self, exc: BaseException | str, error_type: str | None = None) -> None:
        """A failure the Router handles itself (e.g. ``ServiceError`` -> gRPC status)."""
        self._error = error_type or (type(exc).__name__ if isinstance(exc, BaseException) else "error")
        self._span.set_error(exc, error_type)

    def __enter__(self) -> "RequestTelemetry":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        e2e = time.perf_counter() - self._t0
        self._span.__exit__(exc_type, exc, tb)
        m = self._metrics
        if m is None:
            return
        if self._final is not None and self._path is not None:
            m.record_request(self._final, path=self._path, reason=self._reason, segment=self._segment,
                             ttft_s=self._ttft, e2e_s=e2e, api=self._api)
            return
        # Rejected, failed or abandoned before the final output: counted, no latency samples.
        cancelled = exc_type is not None and exc_type.__name__ in ("GeneratorExit", "CancelledError")
        outcome = "cancelled" if cancelled else "error"
        m.record_unfinished(path=self._path, reason=self._reason if self._path is not None else self._error,
                            segment=self._segment, finish_reason=outcome, api=self._api)
