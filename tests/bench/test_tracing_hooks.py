"""Overhead of the engine-side recorder: the design choice (summary span + per-step events built at
finish) against the alternative (a live span per step), with the real SDK/OTLP pipeline."""
from __future__ import annotations

from cluster.bench import tracing_hooks as bench
from tests.telemetry.conftest import receiver, traced  # noqa: F401  (fixtures: a real OTLP receiver)


def test_step_hook_is_far_cheaper_than_a_span_per_step(traced):
    summary = min(bench.per_step_cost_us("summary", 5000) for _ in range(3))
    per_step = min(bench.per_step_cost_us("per_step_span", 2000) for _ in range(3))
    assert summary * 5 < per_step, (summary, per_step)
    assert summary < 5.0, summary  # a list append and a clock read


def test_request_cost_stays_under_budget(traced):
    steps = 64
    summary = min(bench.per_request_cost_us(bench.request_summary, steps, n=20) for _ in range(3))
    per_step = min(bench.per_request_cost_us(bench.request_per_step_spans, steps, n=20) for _ in range(3))
    assert summary < per_step, (summary, per_step)
    # Budget: 3 % of a 64-step request at 5 ms per step (a batch-1 GPU decode step of a small model).
    assert summary < 0.03 * steps * 5000, summary
