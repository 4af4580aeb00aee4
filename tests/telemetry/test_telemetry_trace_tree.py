"""End-to-end span tree over real transports: client traceparent -> router span -> (pickled dict
carrier, another thread: as across a Ray DeploymentHandle) -> engine spans -> KVSync CLIENT spans
over a real gRPC channel -> KVSync SERVER spans, all exported over OTLP/gRPC to a real receiver."""
from __future__ import annotations

import asyncio
import pickle
import threading

import grpc

from cluster.common.request import FinishReason, RequestOutput, SpecStats
from cluster.telemetry import semconv as sc, tracing
from cluster.telemetry.engine_spans import kvsync_context, start_request_trace
from cluster.telemetry.grpc_interceptors import aio_client_interceptors, client_interceptors
from cluster.telemetry.request_span import request_span
from tests.telemetry import fake_kvsync

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
STEPS = [(4, 4), (4, 2), (3, 0), (0, 0), (5, 5)]  # (K, accepted) per verification step
SPAN_SERVER, SPAN_CLIENT = 2, 3


def _engine_side(carrier, other_carrier, call_kvsync):
    """What the engine replica does for one request, with a second request in the same batch."""
    rec = start_request_trace(carrier, "req-1", engine="spec", segment="code", drafter="draft-model")
    other = start_request_trace(other_carrier, "req-2", engine="spec", segment="chat", drafter="draft-model")
    rec.admitted()
    other.admitted()
    rec.prefill_done()
    other.prefill_done()
    for i, (k, accepted) in enumerate(STEPS):
        with kvsync_context([rec, other]):
            call_kvsync(b"resync" if i == 1 else b"step")
        if i == 1:
            rec.resync(num_tokens=17, reason="prefix missing")
        rec.step(k, accepted)
        other.step(k, 0)
    rec.fallback("draft unavailable")
    rec.finish(FinishReason.LENGTH, num_output_tokens=20, num_prompt_tokens=9)
    other.finish(FinishReason.STOP, num_output_tokens=5, num_prompt_tokens=3)


def _run_request(receiver, call_kvsync):
    spec = SpecStats()
    for k, a in STEPS:
        spec.record(k, a)
    final = RequestOutput("req-1", [], "", finished=True, finish_reason=FinishReason.LENGTH,
                          num_prompt_tokens=9, num_output_tokens=20, spec=spec)
    with request_span(model="smollm2-135m", max_tokens=20, temperature=0.0, top_p=1.0, segment="code",
                      request_id="req-1", metadata=[("traceparent", TRACEPARENT), ("authorization", "x")]) as span:
        span.set_route("SPECULATIVE", "low_concurrency", inflight=1)
        carrier = pickle.loads(pickle.dumps(span.carrier()))  # what a Ray handle call does to it
        with request_span(model="smollm2-135m", max_tokens=5, segment="chat") as other_span:
            other_carrier = pickle.loads(pickle.dumps(other_span.carrier()))
            worker = threading.Thread(target=_engine_side, args=(carrier, other_carrier, call_kvsync))
            worker.start()
            worker.join(30)
            assert not worker.is_alive()
        span.first_token()
        span.finish_from_output(final)
    assert tracing.force_flush()
    return receiver.wait_for(lambda spans: sum(s.name == "specserve.v1.KVSync/Propose" for s in spans) == 2 * len(STEPS)
                             and sum(s.name == sc.SPAN_ENGINE for s in spans) == 2
                             and sum(s.name.startswith("text_completion") for s in spans) == 2)


def _assert_tree(spans, server_metadata):
    by_id = {s.span_id: s for s in spans}
    children = lambda parent, name: [s for s in spans if s.parent_span_id == parent.span_id and s.name == name]  # noqa: E731

    router = next(s for s in spans if s.attributes.get(sc.REQUEST_ID) == "req-1" and s.kind == SPAN_SERVER
                  and s.name == "text_completion smollm2-135m")
    # Continuation of the client's trace.
    assert router.trace_id == CLIENT_TRACE_ID
    assert router.parent_span_id == CLIENT_SPAN_ID
    assert router.service_name == "specserve-test"
    a = router.attributes
    assert a[sc.GEN_AI_OPERATION_NAME] == "text_completion"
    assert a[sc.GEN_AI_REQUEST_MODEL] == "smollm2-135m"
    assert a[sc.GEN_AI_REQUEST_MAX_TOKENS] == 20
    assert a[sc.GEN_AI_REQUEST_TEMPERATURE] == 0.0
    assert a[sc.GEN_AI_REQUEST_TOP_P] == 1.0
    assert a[sc.GEN_AI_USAGE_INPUT_TOKENS] == 9
    assert a[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 20
    assert a[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert a[sc.ROUTE_PATH] == "speculative"
    assert a[sc.ROUTE_REASON] == "low_concurrency"
    assert a[sc.INFLIGHT] == 1
    assert a[sc.SEGMENT] == "code"
    assert a[sc.SPEC_DRAFT_TOKENS] == 16 and a[sc.SPEC_ACCEPTED_TOKENS] == 11
    assert sc.TTFT_MS in a and [e[0] for e in router.events] == [sc.EVENT_ROUTE, sc.EVENT_FIRST_TOKEN]

    (engine,) = children(router, sc.SPAN_ENGINE)
    assert engine.trace_id == CLIENT_TRACE_ID and engine.kind == SPAN_SERVER
    assert engine.attributes[sc.SEGMENT] == "code" and engine.attributes[sc.FINISH_REASON] == "length"
    assert engine.attributes[sc.OUTPUT_TOKENS] == 20
    (queue,) = children(engine, sc.SPAN_QUEUE_WAIT)
    (prefill,) = children(engine, sc.SPAN_PREFILL)
    (decode,) = children(engine, sc.SPAN_SPEC_DECODE)
    # Phases are ordered and nested in the engine span.
    assert engine.start_ns <= queue.start_ns <= queue.end_ns <= prefill.start_ns <= prefill.end_ns
    assert prefill.end_ns == decode.start_ns <= decode.end_ns <= engine.end_ns <= router.end_ns
    assert prefill.attributes[sc.PROMPT_TOKENS] == 9

    d = decode.attributes
    assert d[sc.SPEC_DRAFTER] == "draft-model"
    assert d[sc.SPEC_STEPS] == len(STEPS)
    assert d[sc.SPEC_NUM_DRAFT_TOKENS_PER_STEP] == [k for k, _ in STEPS]
    assert d[sc.SPEC_ACCEPTED_PER_STEP] == [acc for _, acc in STEPS]
    assert d[sc.SPEC_DRAFT_TOKENS] == 16 and d[sc.SPEC_ACCEPTED_TOKENS] == 11
    assert d[sc.SPEC_ACCEPTANCE_RATE] == round(11 / 16, 4)  # accepted / drafted
    assert d[sc.SPEC_ALPHA] == round(11 / 13, 4)  # per position: 2 steps rejected a draft
    assert d[sc.SPEC_MEAN_ACCEPTANCE_LENGTH] == round((11 + 4) / 4, 4)  # 4 steps drafted (one K=0)
    assert d[sc.SPEC_RESYNCS] == 1 and d[sc.SPEC_FALLBACKS] == 1
    step_events = [e for e in decode.events if e[0] == sc.EVENT_SPEC_STEP]
    assert [(e[2][sc.SPEC_NUM_DRAFT_TOKENS], e[2][sc.SPEC_ACCEPTED]) for e in step_events] == STEPS
    assert [e[2][sc.SPEC_STEP] for e in step_events] == list(range(len(STEPS)))
    assert all(e[2][sc.SPEC_DRAFTER] == "draft-model" for e in step_events)
    assert all(decode.start_ns <= e[1] <= decode.end_ns for e in decode.events)
    (resync,) = [e for e in decode.events if e[0] == sc.EVENT_DRAFT_RESYNC]
    assert resync[2] == {sc.DRAFT_REASON: "prefix missing", sc.DRAFT_NUM_TOKENS: 17}
    (fallback,) = [e for e in decode.events if e[0] == sc.EVENT_DRAFT_FALLBACK]
    assert fallback[2] == {sc.DRAFT_REASON: "draft unavailable"}

    # KVSync: one CLIENT span per step under this request's decode span, linked to the other request.
    other_engine = next(s for s in spans if s.name == sc.SPAN_ENGINE and s.attributes[sc.REQUEST_ID] == "req-2")
    (other_decode,) = children(other_engine, sc.SPAN_SPEC_DECODE)
    assert other_decode.trace_id != CLIENT_TRACE_ID  # the other request is its own (root) trace
    rpc_clients = children(decode, "specserve.v1.KVSync/Propose")
    assert len(rpc_clients) == len(STEPS)
    for c in rpc_clients:
        assert c.kind == SPAN_CLIENT
        assert c.attributes[sc.RPC_SYSTEM] == "grpc"
        assert c.attributes[sc.RPC_SERVICE] == "specserve.v1.KVSync"
        assert c.attributes[sc.RPC_METHOD] == "Propose"
        assert c.attributes[sc.RPC_GRPC_STATUS_CODE] == 0
        assert c.links == [(other_decode.trace_id, other_decode.span_id)]
        (server,) = children(c, "specserve.v1.KVSync/Propose")
        assert server.kind == SPAN_SERVER and server.trace_id == CLIENT_TRACE_ID
        assert c.start_ns <= server.start_ns and server.end_ns <= c.end_ns
    server_events = [e[0] for c in rpc_clients for s in children(c, c.name) for e in s.events]
    assert server_events == ["draft.resync"]
    # The server saw W3C context naming the CLIENT span (not the decode span) as parent.
    sent = {m["traceparent"].split("-")[2] for m in server_metadata}
    assert sent == {c.span_id for c in rpc_clients}
    # Every span of request 1 is in the client's trace, and every parent exists (or is the client's).
    mine = [s for s in spans if s.trace_id == CLIENT_TRACE_ID]
    assert len(mine) == 1 + 1 + 3 + 2 * len(STEPS)
    assert all(s.parent_span_id in by_id or s.parent_span_id == CLIENT_SPAN_ID for s in mine)


def test_span_tree_sync_grpc(traced):
    recorder = fake_kvsync.Recorder()
    server, port = fake_kvsync.sync_server(recorder)
    channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), *client_interceptors())
    propose = channel.unary_unary(fake_kvsync.PROPOSE)
    try:
        spans = _run_request(traced, lambda payload: propose(payload, timeout=5))
    finally:
        channel.close()
        server.stop(None)
    _assert_tree(spans, recorder.metadata)


def test_span_tree_asyncio_grpc(traced):
    recorder = fake_kvsync.Recorder()
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()

    async def setup():
        server, port = fake_kvsync.aio_server(recorder)
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=aio_client_interceptors())
        return server, channel

    server, channel = asyncio.run_coroutine_threadsafe(setup(), loop).result(10)
    propose = channel.unary_unary(fake_kvsync.PROPOSE)

    def call(payload):
        # The engine thread's OpenTelemetry context must reach the coroutine: contextvars are copied
        # into the task only when it is created from this thread's context.
        async def go():
            return await propose(payload, timeout=5)
        import contextvars
        ctx = contextvars.copy_context()
        return ctx.run(asyncio.run_coroutine_threadsafe, go(), loop).result(10)

    try:
        spans = _run_request(traced, call)
    finally:
        asyncio.run_coroutine_threadsafe(channel.close(), loop).result(10)
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)
    _assert_tree(spans, recorder.metadata)


def test_failed_kvsync_marks_client_and_server_spans(traced):
    recorder = fake_kvsync.Recorder()
    server, port = fake_kvsync.sync_server(recorder)
    channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), *client_interceptors())
    fail = channel.unary_unary(fake_kvsync.FAIL)
    watch = channel.unary_stream(fake_kvsync.STREAM)
    try:
        rec = start_request_trace({}, "req-f", engine="spec")
        rec.admitted()
        rec.prefill_done()
        with kvsync_context([rec]):
            try:
                fail(b"x", timeout=5)
                raise AssertionError("expected UNAVAILABLE")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                rec.fallback("draft unavailable")
            assert list(watch(b"x", timeout=5)) == [b"\x00", b"\x01", b"\x02"]
        rec.finish(FinishReason.STOP, num_output_tokens=1)
    finally:
        channel.close()
        server.stop(None)
    tracing.force_flush()
    spans = traced.wait_for(lambda s: sum(x.name.endswith("/Fail") for x in s) == 2
                            and sum(x.name.endswith("/Watch") for x in s) == 2
                            and any(x.name == sc.SPAN_ENGINE for x in s))
    fails = [s for s in spans if s.name.endswith("/Fail")]
    for s in fails:
        assert s.status_code == 2
        assert s.attributes[sc.RPC_GRPC_STATUS_CODE] == grpc.StatusCode.UNAVAILABLE.value[0]
    watches = {s.kind: s for s in spans if s.name.endswith("/Watch")}
    assert watches[SPAN_SERVER].parent_span_id == watches[SPAN_CLIENT].span_id
    assert watches[SPAN_CLIENT].status_code == 0
    decode = next(s for s in spans if s.name == sc.SPAN_DECODE)  # no spec steps: plain decode name
    assert [e[0] for e in decode.events] == [sc.EVENT_DRAFT_FALLBACK]
    assert {s.parent_span_id for s in spans if s.kind == SPAN_CLIENT} == {decode.span_id}
