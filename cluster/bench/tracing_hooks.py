"""Microbenchmark: what the tracing hooks cost one request at concurrency 1 (not a test; prints).

Run from the repository root (the OTLP receiver is a test helper, ``tests/telemetry/otlp_receiver.py``):
``.venv/bin/python -m cluster.bench.tracing_hooks [--steps 64] [--step-ms 2]``

Measures, per decode step and per request, with the real SDK pipeline (BatchSpanProcessor + OTLP
exporter to a local receiver):
- ``off``: all hooks with tracing disabled (the no-op path);
- ``summary``: the chosen design — ``RequestTrace.step()`` appends, spans/events built at finish;
- ``per_step_span``: the alternative — a live span per verification step;
and the relative slowdown of a simulated request whose steps take ``--step-ms`` of busy work
(interleaved repeats, medians). ``tests/bench/test_tracing_hooks.py`` asserts on the same functions.
"""
from __future__ import annotations

import argparse
import statistics
import time

from opentelemetry import trace

from cluster.bench import from_test_tree
from cluster.telemetry import tracing
from cluster.telemetry.config import TelemetryConfig
from cluster.telemetry.engine_spans import kvsync_context, start_request_trace
from cluster.telemetry.request_span import request_span

STEP = (4, 3)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def request_summary(steps: int, step_s: float = 0.0) -> None:
    """One request with the shipped hooks (router span + engine recorder)."""
    with request_span(model="m", max_tokens=steps * 4, temperature=0.0, top_p=1.0, segment="code") as span:
        span.set_route("speculative", "low_concurrency", 1)
        rec = start_request_trace(span.carrier(), "r", engine="spec", segment="code", drafter="ngram")
        rec.admitted()
        _busy(step_s)
        rec.prefill_done()
        span.first_token()
        for _ in range(steps):
            with kvsync_context((rec,)):
                pass
            _busy(step_s)
            rec.step(*STEP)
        rec.finish("length", steps * 4, 16)
        span.set_usage(16, steps * 4)


def request_per_step_spans(steps: int, step_s: float = 0.0) -> None:
    """The alternative: a live span per verification step under the decode span."""
    tracer = tracing.get_tracer()
    with request_span(model="m", max_tokens=steps * 4, segment="code") as span:
        rec = start_request_trace(span.carrier(), "r", engine="spec", drafter="ngram")
        rec.admitted()
        _busy(step_s)
        rec.prefill_done()
        parent = rec.context
        for i in range(steps):
            s = tracer.start_span("specserve.spec_step", context=parent)
            _busy(step_s)
            s.set_attributes({"specserve.spec.step": i, "specserve.spec.num_draft_tokens": STEP[0],
                              "specserve.spec.accepted": STEP[1]})
            s.end()
        rec.finish("length", steps * 4, 16)


def per_step_cost_us(kind: str, n: int = 20000) -> float:
    """Hot-loop cost of recording one step, in µs (spans emitted at the end are not counted)."""
    if kind == "summary":
        rec = start_request_trace({}, "r", engine="spec")
        rec.prefill_done()
        t0 = time.perf_counter()
        for _ in range(n):
            rec.step(4, 3)
        dt = time.perf_counter() - t0
        rec.finish("length", n)
        return dt / n * 1e6
    tracer = tracing.get_tracer()
    parent = trace.set_span_in_context(tracer.start_span("p"))
    t0 = time.perf_counter()
    for i in range(n):
        s = tracer.start_span("specserve.spec_step", context=parent)
        s.set_attributes({"specserve.spec.step": i, "specserve.spec.num_draft_tokens": 4, "specserve.spec.accepted": 3})
        s.end()
    return (time.perf_counter() - t0) / n * 1e6


def per_request_cost_us(fn, steps: int, n: int = 200) -> float:
    fn(steps)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(steps)
    return (time.perf_counter() - t0) / n * 1e6


def relative_overhead(endpoint: str, steps: int, step_s: float, repeats: int = 7) -> dict[str, float]:
    """Median wall time of a simulated request, each mode interleaved; returns % over ``off``."""
    cfg_on = TelemetryConfig.resolve({"otlp_endpoint": endpoint}, env={})
    times: dict[str, list[float]] = {"off": [], "summary": [], "per_step_span": []}
    for _ in range(repeats):
        for mode in times:
            tracing.configure_tracing(TelemetryConfig.disabled() if mode == "off" else cfg_on)
            fn = request_per_step_spans if mode == "per_step_span" else request_summary
            t0 = time.perf_counter()
            fn(steps, step_s)
            times[mode].append(time.perf_counter() - t0)
            tracing.force_flush()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {k: (med[k] / med["off"] - 1.0) * 100.0 for k in ("summary", "per_step_span")} | {"off_ms": med["off"] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=2.0)
    args = ap.parse_args()
    OtlpReceiver = from_test_tree("tests.telemetry.otlp_receiver", "OtlpReceiver", "cluster.bench.tracing_hooks")

    with OtlpReceiver() as receiver:
        cfg = TelemetryConfig.resolve({"otlp_endpoint": receiver.endpoint}, env={})
        tracing.configure_tracing(TelemetryConfig.disabled())
        off = per_request_cost_us(request_summary, args.steps)
        tracing.configure_tracing(cfg)
        rows = {
            "off: hooks per request (us)": off,
            "summary: step() (us/step)": per_step_cost_us("summary"),
            "per_step_span: span (us/step)": per_step_cost_us("per_step_span"),
            f"summary: request of {args.steps} steps, CPU (us)": per_request_cost_us(request_summary, args.steps),
            f"per_step_span: request of {args.steps} steps, CPU (us)":
                per_request_cost_us(request_per_step_spans, args.steps),
        }
        tracing.force_flush()
        rel = relative_overhead(receiver.endpoint, args.steps, args.step_ms / 1e3)
        tracing.shutdown_tracing()
    for k, v in rows.items():
        print(f"{k:55s} {v:10.2f}")
    print(f"simulated request: {args.steps} steps x {args.step_ms} ms, off median {rel['off_ms']:.1f} ms")
    print(f"  overhead summary (shipped)  {rel['summary']:+.2f} %")
    print(f"  overhead per-step spans     {rel['per_step_span']:+.2f} %")


if __name__ == "__main__":
    main()
