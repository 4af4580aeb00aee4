"""End-to-end traces from a real Serve app running the real engine on the default model
(SmolLM2-135M), placement ``separate`` with the n-gram drafter in the DraftServer, exported over
OTLP/gRPC to the real receiver in this process.

One request through the gRPC front door carries a client ``traceparent``; its trace must be::

    text_completion default            Router, SERVER, parent = the client's span
    └─ specserve.engine.generate       SpecEngine replica, SERVER
       ├─ specserve.queue_wait
       ├─ specserve.prefill
       └─ specserve.speculative_decode  spec.step events {step, K, accepted, drafter}
          └─ specserve.v1.KVSync/Propose              CLIENT (SpecEngine replica)
             └─ specserve.v1.KVSync/Propose           SERVER (DraftServer replica)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.api.stubs import generation_pb2 as client_pb2
from tests.deployments.harness import SMALL, Client
from tests.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.ray, pytest.mark.model]
WORKLOADS = Path(__file__).resolve().parents[3] / "shared" / "workloads"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
PROPOSE = "specserve.v1.KVSync/Propose"
MAX_TOKENS = 24


def _args(endpoint: str) -> dict:
    eng = {**SMALL, "num_cpus": 0.2, "max_num_seqs": 4, "kv_cache_memory_mb": 64}
    return {"model": "default", "drafter": "ngram", "num_draft_tokens": 4, "torch_threads": 1,
            "placement": "separate", "router_deployment": SMALL, "spec_engine": eng, "batch_engine": eng,
            "draft_server": {**SMALL, "host": "127.0.0.1", "timeout_s": 5.0},
            "limits": {"max_tokens": 256, "max_prompt_tokens": 1024, "max_message_bytes": 65536,
                       "max_queue": 16},
            "telemetry": {"otlp_endpoint": endpoint, "sampling_ratio": 1.0, "service_name": "specserve-real"}}


def _code_prompt() -> str:
    """An input-grounded prompt (code): the n-gram drafter finds matches, so steps accept tokens."""
    with open(WORKLOADS / "code.jsonl") as f:
        return json.loads(f.readline())["prompt"][:400]


@pytest.fixture(scope="module")
def traced_request(serve_shared):
    """Start the app once, send one traced speculative request, return (response, its spans)."""
    with OtlpReceiver() as receiver:
        # the shared session's replicas flush every 200 ms instead of 5 s (harness.SHARED_ENV)
        with serve_shared.apps({"sep": _args(receiver.endpoint)}, timeout_s=300) as addrs:
            client = Client(addrs.grpc, "sep")
            client.wait_ready(timeout_s=300)
            md = client.md + [("traceparent", f"00-{TRACE_ID}-{PARENT}-01")]
            resp = client.generate(md=md, prompt=_code_prompt(), max_tokens=MAX_TOKENS, temperature=0.0,
                                   mode=0, segment="code", timeout=120)  # mode 0 = AUTO

            def complete(spans: list[ReceivedSpan]) -> bool:
                mine = [s for s in spans if s.trace_id == TRACE_ID]
                names = {s.name for s in mine}
                servers = [s for s in mine if s.name == PROPOSE and s.kind == SERVER]
                return (any(n.startswith("text_completion") for n in names)
                        and {"specserve.engine.generate", "specserve.queue_wait", "specserve.prefill",
                             "specserve.speculative_decode"} <= names and bool(servers))
            spans = receiver.wait_for(complete, timeout=60)
    return resp, [s for s in spans if s.trace_id == TRACE_ID]


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"expected one {name!r} span, got {[s.name for s in spans]}"
    return found[0]


def test_router_span_continues_client_trace_with_genai_attributes(traced_request):
    resp, spans = traced_request
    router = next(s for s in spans if s.name.startswith("text_completion"))
    assert router.name == "text_completion default"
    assert router.parent_span_id == PARENT and router.kind == SERVER  # the client's trace continues
    assert router.service_name == "specserve-real"
    a = router.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == "default"
    assert a["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.top_p"] == 1.0
    assert a["gen_ai.usage.input_tokens"] == resp.usage.prompt_tokens > 0
    assert a["gen_ai.usage.output_tokens"] == resp.usage.completion_tokens == len(resp.token_ids) > 0
    finish = client_pb2().FinishReason.Name(resp.finish_reason).removeprefix("FINISH_REASON_").lower()
    assert finish in ("length", "eos", "stop") and a["gen_ai.response.finish_reasons"] == [finish]
    # mode AUTO, nothing else in flight, no α samples yet: the policy picks speculation by concurrency
    assert a["specserve.route.path"] == "speculative" and resp.route.path == 1
    assert a["specserve.route.reason"] == resp.route.reason == "below_enter_threshold"
    assert a["specserve.inflight"] == 0 and a["specserve.segment"] == "code"
    assert a["specserve.spec.draft_tokens"] == resp.spec.draft_tokens > 0
    assert a["specserve.spec.accepted_tokens"] == resp.spec.accepted_tokens


def test_engine_spans_queue_prefill_speculative_decode(traced_request):
    resp, spans = traced_request
    router = next(s for s in spans if s.name.startswith("text_completion"))
    engine = _one(spans, "specserve.engine.generate")
    assert engine.parent_span_id == router.span_id and engine.kind == SERVER  # across the Ray handle
    assert engine.attributes["specserve.engine"] == "spec"
    assert engine.attributes["specserve.output_tokens"] == len(resp.token_ids)
    queue, prefill = _one(spans, "specserve.queue_wait"), _one(spans, "specserve.prefill")
    decode = _one(spans, "specserve.speculative_decode")
    for child in (queue, prefill, decode):
        assert child.parent_span_id == engine.span_id
        assert engine.start_ns <= child.start_ns <= child.end_ns <= engine.end_ns
    assert queue.end_ns <= prefill.start_ns + 1 and prefill.end_ns <= decode.start_ns + 1  # in order
    assert prefill.attributes["specserve.prompt_tokens"] == resp.usage.prompt_tokens

    d = decode.attributes
    assert d["specserve.spec.drafter"] == "ngram"  # what drafts; the KVSync spans show where
    steps = [e for e in decode.events if e[0] == "spec.step"]
    assert len(steps) == d["specserve.spec.steps"] > 0
    num_draft_tokens = [e[2]["specserve.spec.num_draft_tokens"] for e in steps]
    acc = [e[2]["specserve.spec.accepted"] for e in steps]
    assert [e[2]["specserve.spec.step"] for e in steps] == list(range(len(steps)))
    assert all(e[2]["specserve.spec.drafter"] == "ngram" for e in steps)
    assert all(0 <= a_ <= k <= 4 for k, a_ in zip(num_draft_tokens, acc))  # num_draft_tokens=4
    assert num_draft_tokens == d["specserve.spec.num_draft_tokens_per_step"] and acc == d["specserve.spec.accepted_per_step"]
    assert sum(num_draft_tokens) == d["specserve.spec.draft_tokens"] == resp.spec.draft_tokens > 0
    assert sum(acc) == d["specserve.spec.accepted_tokens"] == resp.spec.accepted_tokens
    times = [e[1] for e in steps]
    assert times == sorted(times) and decode.start_ns <= times[0] and times[-1] <= decode.end_ns

    # unary Generate gets every token in one final output; the Router still dates the first token
    # where the engine produced it (end of prefill), not where the whole response arrived
    first = [e for e in router.events if e[0] == "first_token"]
    assert len(first) == 1
    ttft_ns = first[0][1]
    assert prefill.start_ns <= ttft_ns <= min(decode.start_ns + 100_000_000, decode.end_ns)
    assert router.attributes["specserve.ttft_ms"] == pytest.approx((ttft_ns - router.start_ns) / 1e6, abs=1.0)


def test_kvsync_client_and_server_spans_propagate_context(traced_request):
    _, spans = traced_request
    engine = _one(spans, "specserve.engine.generate")
    decode = _one(spans, "specserve.speculative_decode")
    clients = [s for s in spans if s.name == PROPOSE and s.kind == CLIENT]
    servers = [s for s in spans if s.name == PROPOSE and s.kind == SERVER]
    assert clients and servers
    # Every Propose of this request hangs under the engine's spans (prefill-time proposals under the
    # engine span, decode steps under the decode span); most are decode steps.
    assert {c.parent_span_id for c in clients} <= {engine.span_id, decode.span_id}
    assert any(c.parent_span_id == decode.span_id for c in clients)
    for c in clients:
        assert c.attributes["rpc.system"] == "grpc" and c.attributes["rpc.method"] == "Propose"
        assert c.attributes["rpc.grpc.status_code"] == 0
    # Context crossed the KVSync gRPC call: each SERVER span's parent is a CLIENT span of this trace.
    by_id = {c.span_id: c for c in clients}
    for s in servers:
        assert s.parent_span_id in by_id, "server span without its client span"
        c = by_id[s.parent_span_id]
        assert c.start_ns <= s.start_ns and s.end_ns <= c.end_ns + 5_000_000  # clocks: one host
        assert s.attributes["rpc.service"] == "specserve.v1.KVSync"
    # Decode-time proposals: one client span per drafting step of this request (first at prefill).
    steps = [e for e in decode.events if e[0] == "spec.step"]
    assert len([c for c in clients if c.parent_span_id == decode.span_id]) >= len(steps) - 1
