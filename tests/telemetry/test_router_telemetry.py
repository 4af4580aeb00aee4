"""RequestTelemetry (the Router's four calls): span + metrics for finished, rejected and cancelled
requests; engine stats exported from the deployments' dict form; preemption events."""
from __future__ import annotations

import asyncio
import enum
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.common.request import FinishReason, RequestOutput, SamplingParams, SpecMode, SpecStats
from cluster.engine.protocol import EngineStats
from cluster.telemetry import semconv as sc, tracing
from cluster.telemetry.engine_spans import start_request_trace
from cluster.telemetry.metrics import MetricsConfig, SpecserveMetrics, export_engine_stats_forever
from cluster.telemetry.router_telemetry import API_OPENAI, RequestTelemetry


class Path(enum.Enum):  # mirrors cluster.routing.policy (kept local: no coupling to its churn)
    SPECULATIVE = "speculative"
    PLAIN = "plain"


def _scrape(metrics):
    port = metrics.backend.serve(0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def metrics():
    m = SpecserveMetrics(MetricsConfig(backend="prometheus"))
    yield m
    m.backend.stop()


def _vreq(rid, messages=False):
    return SimpleNamespace(request_id=rid, params=SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3),
                           mode=SpecMode.AUTO, segment="chat",
                           prompt=SimpleNamespace(text=None if messages else "hi",
                                                  messages=[("user", "hi")] if messages else None))


def test_finished_rejected_and_cancelled_requests(traced, metrics):
    spec = SpecStats()
    spec.record(4, 3)
    decision = SimpleNamespace(path=Path.SPECULATIVE, reason=SimpleNamespace(value="below_enter_threshold"))
    with RequestTelemetry(metrics, model="smollm2", metadata=[], stream=True) as tel:
        tel.routed(_vreq("ok-1", messages=True), decision, inflight=2)
        carrier = tel.carrier()
        assert carrier["traceparent"].split("-")[2] == format(tel.span.span.get_span_context().span_id, "016x")
        tel.output(RequestOutput("ok-1", [5], "a"))
        tel.output(RequestOutput("ok-1", [6, 7, 8], "bcd", finished=True, finish_reason=FinishReason.EOS,
                                 num_prompt_tokens=4, num_output_tokens=4, spec=spec))
    with RequestTelemetry(metrics, model="smollm2") as tel:
        tel.error("max_tokens must be positive", "INVALID_ARGUMENT")
    with pytest.raises(asyncio.CancelledError):
        with RequestTelemetry(metrics, model="smollm2", api=API_OPENAI) as tel:  # the HTTP front end
            tel.routed(_vreq("gone-1"), SimpleNamespace(path=Path.PLAIN, reason="above_exit_threshold"))
            tel.output(RequestOutput("gone-1", [1], "x"))
            raise asyncio.CancelledError()

    s = _scrape(metrics)
    assert s[("specserve_requests_total", frozenset({"path": "speculative", "reason": "below_enter_threshold",
                                                     "segment": "chat", "finish_reason": "eos", "api": "grpc"}.items()))] == 1
    assert s[("specserve_requests_total", frozenset({"path": "none", "reason": "invalid_argument",
                                                     "segment": "default", "finish_reason": "error", "api": "grpc"}.items()))] == 1
    assert s[("specserve_requests_total", frozenset({"path": "plain", "reason": "above_exit_threshold",
                                                     "segment": "chat", "finish_reason": "cancelled", "api": "openai"}.items()))] == 1
    assert s[("specserve_ttft_seconds_count", frozenset({"path": "speculative", "segment": "chat"}.items()))] == 1
    assert ("specserve_ttft_seconds_count", frozenset({"path": "plain", "segment": "chat"}.items())) not in s

    tracing.force_flush()
    spans = traced.wait_for(lambda sp: len(sp) >= 3)
    ok = next(x for x in spans if x.attributes.get(sc.REQUEST_ID) == "ok-1")
    assert ok.name == "text_completion smollm2"  # named at start; the operation attribute is refined
    a = ok.attributes
    assert a[sc.GEN_AI_OPERATION_NAME] == "chat"
    assert (a[sc.GEN_AI_REQUEST_MAX_TOKENS], a[sc.GEN_AI_REQUEST_TEMPERATURE], a[sc.GEN_AI_REQUEST_TOP_P]) == (8, 0.7, 0.9)
    assert a[sc.GEN_AI_REQUEST_SEED] == 3 and a[sc.MODE] == "auto" and a[sc.STREAM] is True
    assert a[sc.ROUTE_PATH] == "speculative" and a[sc.INFLIGHT] == 2
    assert a[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ["eos"]
    assert (a[sc.GEN_AI_USAGE_INPUT_TOKENS], a[sc.GEN_AI_USAGE_OUTPUT_TOKENS]) == (4, 4)
    assert ok.parent_span_id == ""  # no client traceparent: a root span
    assert a[sc.API] == "grpc"  # the front end
    rejected = next(x for x in spans if x.attributes.get(sc.ERROR_TYPE) == "INVALID_ARGUMENT")
    assert rejected.status_code == 2
    gone = next(x for x in spans if x.attributes.get(sc.REQUEST_ID) == "gone-1")
    assert gone.status_code == 2 and gone.attributes[sc.ERROR_TYPE] == "CancelledError"
    assert gone.attributes[sc.API] == "openai"


def test_whole_response_dates_the_first_token_by_engine_timings(traced, metrics):
    """Unary Generate receives every token in one final output: TTFT is the time to that output
    minus what the engine spent after its first token, and the span event is back-dated."""
    import time

    decision = SimpleNamespace(path=Path.PLAIN, reason=SimpleNamespace(value="mode_plain"))
    with RequestTelemetry(metrics, model="smollm2", metadata=[]) as tel:
        tel.routed(_vreq("whole-1"), decision)
        time.sleep(0.3)  # the engine runs: first token after 0.05 s, final output at 0.3 s
        t_out = time.perf_counter()
        tel.output(RequestOutput("whole-1", [5, 6, 7], "abc", finished=True, finish_reason=FinishReason.LENGTH,
                                 num_prompt_tokens=2, num_output_tokens=3,
                                 first_token_time=0.05, finish_time=0.3))
        ttft = tel._ttft
        assert ttft == pytest.approx(t_out - tel._t0 - 0.25, abs=0.02) and ttft < 0.1
    tracing.force_flush()
    span = next(x for x in traced.wait_for(lambda sp: any(y.attributes.get(sc.REQUEST_ID) == "whole-1"
                                                          for y in sp))
                if x.attributes.get(sc.REQUEST_ID) == "whole-1")
    (event,) = [e for e in span.events if e[0] == sc.EVENT_FIRST_TOKEN]
    assert span.start_ns < event[1] < span.end_ns - 200_000_000  # dated near 0.05 s, not at 0.3 s
    assert span.attributes[sc.TTFT_MS] == pytest.approx((event[1] - span.start_ns) / 1e6, abs=1.0)


def test_choices_finish_the_request_once_with_their_summary(traced, metrics):
    """OpenAI ``n``: each choice's finished output does not close the request; the summary does
    (one request counted, every choice's tokens)."""
    from deployments.openai_choices import combined_final

    decision = SimpleNamespace(path=Path.PLAIN, reason=SimpleNamespace(value="mode_plain"))
    finals = [RequestOutput(f"n-1-{i}", [5], "a", finished=True, finish_reason=FinishReason.LENGTH,
                            num_prompt_tokens=3, num_output_tokens=2) for i in range(3)]
    with RequestTelemetry(metrics, model="smollm2", metadata=[], api=API_OPENAI) as tel:
        tel.routed(_vreq("n-1"), decision)
        for out in finals:
            tel.output(out, closes=False)
            assert tel._final is None
        tel.output(combined_final(finals))
    s = _scrape(metrics)
    assert s[("specserve_requests_total", frozenset({"path": "plain", "reason": "mode_plain", "segment": "chat",
                                                     "finish_reason": "length", "api": "openai"}.items()))] == 1
    assert s[("specserve_output_tokens_total", frozenset({"path": "plain"}.items()))] == 6
    tracing.force_flush()
    span = next(x for x in traced.wait_for(lambda sp: any(y.attributes.get(sc.REQUEST_ID) == "n-1" for y in sp))
                if x.attributes.get(sc.REQUEST_ID) == "n-1")
    assert (span.attributes[sc.GEN_AI_USAGE_INPUT_TOKENS], span.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS]) == (3, 6)


def test_engine_stats_dict_and_background_exporter(metrics):
    st = EngineStats(num_running=2, num_waiting=5, kv_blocks_total=100, kv_blocks_free=75, draft_resyncs=4)
    calls = []

    def stats():
        calls.append(1)
        d = st.to_dict()
        d.update(ready=True, in_flight=2)  # what EngineServer.stats() returns
        return d if len(calls) > 1 else {"ready": False, "in_flight": 0}  # first: not ready yet

    async def run():
        task = asyncio.create_task(export_engine_stats_forever(metrics, stats, "batch", period_s=0.01))
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(run())
    s = _scrape(metrics)
    e = frozenset({"engine": "batch"}.items())
    assert s[("specserve_queue_depth", e)] == 5
    assert s[("specserve_kv_usage_ratio", e)] == 0.25
    assert s[("specserve_draft_resyncs_total", e)] == 4  # repeated snapshots are not double counted


def test_preemption_and_queue_only_requests(traced):
    rec = start_request_trace({}, "p-1", engine="batch")
    rec.admitted()
    rec.preempted()
    rec.admitted()  # re-admission after the preemption: the first queue wait stands
    rec.prefill_done()
    rec.finish(FinishReason.LENGTH, num_output_tokens=3)
    queued = start_request_trace({}, "q-1", engine="batch")
    queued.finish(FinishReason.CANCELLED)  # cancelled while waiting: only the queue-wait span
    tracing.force_flush()
    spans = traced.wait_for(lambda sp: sum(x.name == sc.SPAN_ENGINE for x in sp) == 2)
    p_engine = next(x for x in spans if x.attributes.get(sc.REQUEST_ID) == "p-1")
    assert p_engine.attributes[sc.PREEMPTIONS] == 1
    decode = next(x for x in spans if x.name == sc.SPAN_DECODE and x.parent_span_id == p_engine.span_id)
    assert decode.events == []  # the preemption came before decoding: it sits on the engine span
    assert [e[0] for e in p_engine.events] == [sc.EVENT_PREEMPTED]
    assert p_engine.start_ns <= p_engine.events[0][1] <= decode.start_ns
    q_engine = next(x for x in spans if x.attributes.get(sc.REQUEST_ID) == "q-1")
    q_children = sorted(x.name for x in spans if x.parent_span_id == q_engine.span_id)
    assert q_children == [sc.SPAN_QUEUE_WAIT]
    assert q_engine.attributes[sc.FINISH_REASON] == "cancelled"


def test_client_label_is_traced_beside_the_server_id(traced):
    """The client's request_id metadata is a label: traced as its own attribute, while
    specserve.request_id is the server's id (the engine's and KVSync's); a draft scope is traced
    when the request sent one."""
    from cluster.telemetry.router_telemetry import REQUEST_LABEL

    decision = SimpleNamespace(path=Path.PLAIN, reason=SimpleNamespace(value="mode_plain"))
    with RequestTelemetry(None, model="smollm2") as tel:
        vreq = _vreq("server-uuid-1")
        vreq.label, vreq.draft_scope = "client-label", "tenant-7"
        tel.routed(vreq, decision)
    with RequestTelemetry(None, model="smollm2") as tel:
        tel.routed(_vreq("server-uuid-2"), decision)  # no label: no attribute
    tracing.force_flush()
    spans = traced.wait_for(lambda sp: sum(x.attributes.get(sc.REQUEST_ID, "").startswith("server-uuid-")
                                           for x in sp) >= 2)
    by_id = {x.attributes.get(sc.REQUEST_ID): x for x in spans}
    assert by_id["server-uuid-1"].attributes[REQUEST_LABEL] == "client-label"
    assert REQUEST_LABEL not in by_id["server-uuid-2"].attributes
    assert by_id["server-uuid-1"].attributes[sc.DRAFT_SCOPE] == "tenant-7"
    assert sc.DRAFT_SCOPE not in by_id["server-uuid-2"].attributes
