"""Metrics recorded from RequestOutputs and EngineStats, scraped over real HTTP from /metrics."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.common.request import FinishReason, RequestOutput, SpecStats
from cluster.engine.protocol import EngineStats
from cluster.telemetry.metrics import MetricsConfig, SpecserveMetrics


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def _get(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


def _spec(steps):
    st = SpecStats()
    for k, a in steps:
        st.record(k, a)
    return st


def _output(n_prompt, n_out, reason=FinishReason.LENGTH, spec=None):
    return RequestOutput("r", [], "", finished=True, finish_reason=reason, num_prompt_tokens=n_prompt,
                         num_output_tokens=n_out, spec=spec)


@pytest.fixture
def metrics():
    m = SpecserveMetrics(MetricsConfig(backend="prometheus", max_segments=2))
    assert m.backend.name == "prometheus"
    port = m.backend.serve(0)
    yield m, port
    m.backend.stop()


def test_requests_latency_and_acceptance_are_scraped(metrics):
    m, port = metrics
    m.record_request(_output(10, 11, spec=_spec([(4, 4), (4, 2)])), path="SPECULATIVE", reason="low_concurrency",
                     segment="code", ttft_s=0.05, e2e_s=0.25)
    m.record_request(_output(10, 21, spec=_spec([(4, 1)])), path="SPECULATIVE", reason="low_concurrency",
                     segment="code", ttft_s=0.04, e2e_s=0.44)
    m.record_request(_output(7, 3, FinishReason.STOP), path="plain", reason="constrained", segment="json",
                     ttft_s=0.2, e2e_s=0.3, api="openai")
    m.record_request(_output(7, 1, FinishReason.STOP), path="plain", reason="high_concurrency", segment="overflow",
                     ttft_s=0.2, e2e_s=0.2)
    m.set_inflight("speculative", 3)
    s = _scrape(port)
    assert _get(s, "specserve_requests_total", path="speculative", reason="low_concurrency", segment="code",
                finish_reason="length", api="grpc") == 2
    assert _get(s, "specserve_requests_total", path="plain", reason="constrained", segment="json",
                finish_reason="stop", api="openai") == 1
    # Third distinct segment exceeds max_segments=2: bounded cardinality.
    assert _get(s, "specserve_requests_total", path="plain", reason="high_concurrency", segment="other",
                finish_reason="stop", api="grpc") == 1
    assert _get(s, "specserve_ttft_seconds_count", path="speculative", segment="code") == 2
    assert _get(s, "specserve_ttft_seconds_sum", path="speculative", segment="code") == pytest.approx(0.09)
    # TPOT = (e2e - ttft) / (n_out - 1): 0.2/10 = 0.02 and 0.4/20 = 0.02; a 1-token request has none.
    assert _get(s, "specserve_tpot_seconds_sum", path="speculative", segment="code") == pytest.approx(0.04)
    assert _get(s, "specserve_tpot_seconds_bucket", path="speculative", segment="code", le="0.02") == 2
    assert ("specserve_tpot_seconds_count", frozenset({"path": "plain", "segment": "other"}.items())) not in s
    assert _get(s, "specserve_e2e_seconds_count", path="plain", segment="json") == 1
    assert _get(s, "specserve_output_tokens_total", path="speculative") == 32
    assert _get(s, "specserve_prompt_tokens_total", path="plain") == 14
    # Per-request acceptance rate (accepted / drafted): 6/8 = 0.75 and 1/4 = 0.25; α per position
    # (accepted / (accepted + rejections)): 6/7 and 1/2. Plain requests (no drafts) are not observed.
    assert _get(s, "specserve_request_acceptance_rate_count", segment="code") == 2
    assert _get(s, "specserve_request_acceptance_rate_bucket", segment="code", le="0.3") == 1
    assert _get(s, "specserve_request_alpha_count", segment="code") == 2
    assert _get(s, "specserve_request_alpha_sum", segment="code") == pytest.approx(6 / 7 + 0.5)
    assert _get(s, "specserve_inflight", path="speculative") == 3


def _stats(fallbacks, resyncs, segs, free=30, waiting=2):
    by_class = {"base": {"live_alpha": 0.7, "live_draft_tokens": 6}, "sampled": {"live_alpha": 0.2, "live_draft_tokens": 2},
                "unknown": {"live_alpha": 0.1, "live_draft_tokens": 2}}
    by_segment = {k: {**v.to_dict(), "live_alpha": 0.6, "live_draft_tokens": 8, "live_alpha_by_class": by_class}
                  for k, v in segs.items()}
    return EngineStats(num_running=1, num_waiting=waiting, kv_blocks_total=40, kv_blocks_free=free,
                       num_preemptions=0, spec_enabled=True, drafter="ngram", draft_fallbacks=fallbacks,
                       draft_resyncs=resyncs, break_even_alpha=0.3, spec_by_segment=by_segment)


def test_engine_stats_export_gauges_and_counter_deltas(metrics):
    m, port = metrics
    code = _spec([(4, 4), (4, 2), (0, 0)])
    first = _stats(1, 0, {"code": code})
    first.drafter_steps = {"ngram": {"steps": 3, "draft_tokens": 10, "accepted_tokens": 6},
                           "prediction": {"steps": 2, "draft_tokens": 8, "accepted_tokens": 8}}
    m.record_engine_stats(first, engine="spec")
    s = _scrape(port)
    assert _get(s, "specserve_drafter_accepted_tokens_total", engine="spec", drafter="prediction") == 8
    assert _get(s, "specserve_drafter_draft_tokens_total", engine="spec", drafter="ngram") == 10
    assert _get(s, "specserve_drafter_steps_total", engine="spec", drafter="ngram") == 3
    assert _get(s, "specserve_queue_depth", engine="spec") == 2
    assert _get(s, "specserve_running_requests", engine="spec") == 1
    assert _get(s, "specserve_kv_blocks_free", engine="spec") == 30
    assert _get(s, "specserve_kv_blocks_capacity", engine="spec") == 40
    assert _get(s, "specserve_kv_usage_ratio", engine="spec") == pytest.approx(0.25)
    assert _get(s, "specserve_draft_fallbacks_total", engine="spec") == 1
    assert _get(s, "specserve_spec_acceptance_rate", engine="spec", segment="code") == pytest.approx(0.75)
    assert _get(s, "specserve_spec_alpha", engine="spec", segment="code") == pytest.approx(6 / 7)  # 1 rejection
    assert _get(s, "specserve_spec_live_alpha", engine="spec", segment="code") == 0.6
    assert _get(s, "specserve_spec_class_live_alpha", engine="spec", segment="code", **{"class": "base"}) == 0.7
    assert _get(s, "specserve_spec_class_live_alpha", engine="spec", segment="code", **{"class": "sampled"}) == 0.2
    classes = {dict(labels).get("class") for name, labels in s if name == "specserve_spec_class_live_alpha"}
    assert classes == {"base", "sampled"}  # only the four class names become labels
    assert _get(s, "specserve_spec_break_even_alpha", engine="spec") == 0.3
    assert _get(s, "specserve_spec_rejections_total", engine="spec", segment="code") == 1
    assert _get(s, "specserve_spec_position_acceptance_rate", engine="spec", segment="code", position="0") == 1.0
    assert _get(s, "specserve_spec_position_acceptance_rate", engine="spec", segment="code", position="2") == 0.5
    assert _get(s, "specserve_spec_steps_by_num_draft_tokens_total", engine="spec", segment="code", num_draft_tokens="4") == 2
    assert _get(s, "specserve_spec_steps_by_num_draft_tokens_total", engine="spec", segment="code", num_draft_tokens="0") == 1

    # Cumulative totals grow: counters follow the difference, not the sum of snapshots.
    code.record(4, 0)
    code.record(2, 2)
    second = _stats(3, 2, {"code": code}, free=40, waiting=0)
    second.drafter_steps = {"prediction": {"steps": 3, "draft_tokens": 12, "accepted_tokens": 11}}
    m.record_engine_stats(second, engine="spec")
    s = _scrape(port)
    assert _get(s, "specserve_drafter_accepted_tokens_total", engine="spec", drafter="prediction") == 11
    assert _get(s, "specserve_draft_fallbacks_total", engine="spec") == 3
    assert _get(s, "specserve_draft_resyncs_total", engine="spec") == 2
    assert _get(s, "specserve_spec_draft_tokens_total", engine="spec", segment="code") == 14
    assert _get(s, "specserve_spec_accepted_tokens_total", engine="spec", segment="code") == 8
    assert _get(s, "specserve_spec_position_drafted_total", engine="spec", segment="code", position="0") == 4
    assert _get(s, "specserve_spec_position_accepted_total", engine="spec", segment="code", position="0") == 3
    assert _get(s, "specserve_spec_steps_by_num_draft_tokens_total", engine="spec", segment="code", num_draft_tokens="4") == 3
    assert _get(s, "specserve_spec_steps_by_num_draft_tokens_total", engine="spec", segment="code", num_draft_tokens="2") == 1
    assert _get(s, "specserve_kv_usage_ratio", engine="spec") == 0.0
    assert _get(s, "specserve_queue_depth", engine="spec") == 0

    # An engine restart (totals drop) counts the new totals afresh instead of going negative.
    m.record_engine_stats(_stats(1, 0, {"code": _spec([(2, 1)])}), engine="spec")
    s = _scrape(port)
    assert _get(s, "specserve_draft_fallbacks_total", engine="spec") == 4
    assert _get(s, "specserve_spec_draft_tokens_total", engine="spec", segment="code") == 16


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        MetricsConfig(backend="statsd")


def test_metric_definitions_are_valid_for_ray(monkeypatch):
    """Ray's metric registry needs ASCII names/descriptions, positive histogram boundaries and
    string tag values — checked without starting Ray by recording what the backend is asked for."""
    import re

    import cluster.telemetry.metrics as metrics_mod

    made, recorded = [], []

    class Inst:
        def __init__(self, labels):
            self.labels = tuple(labels)

        def _check(self, value, tags):
            assert set(tags or {}) == set(self.labels), (tags, self.labels)
            assert all(isinstance(v, str) for v in (tags or {}).values()), tags
            recorded.append(value)

        inc = set = observe = _check

    class RecordingBackend:
        name = "recording"

        def counter(self, name, doc, labels):
            made.append((name, doc, None))
            return Inst(labels)

        gauge = counter

        def histogram(self, name, doc, labels, buckets):
            made.append((name, doc, list(buckets)))
            return Inst(labels)

    monkeypatch.setattr(metrics_mod, "make_backend", lambda kind: RecordingBackend())
    m = metrics_mod.SpecserveMetrics()
    for name, doc, buckets in made:
        assert re.fullmatch(r"specserve_[a-z0-9_]+", name) and not name.endswith("_total"), name
        assert doc.isascii() and doc, (name, doc)
        assert buckets is None or (all(b > 0 for b in buckets) and buckets == sorted(buckets)), name
    m.record_request(_output(3, 4, spec=_spec([(2, 1)])), path="plain", reason="x", segment="s", ttft_s=0.1, e2e_s=0.2)
    m.record_unfinished(path=None, reason="INVALID_ARGUMENT", segment=None, finish_reason="error")
    m.record_engine_stats(_stats(1, 1, {"s": _spec([(2, 1), (0, 0)])}), engine="spec")
    m.set_inflight("plain", 2)
    assert len(recorded) > 20
