"""Traces from a real Serve app (fake engine) to a real OTLP receiver in the test process: the
Router span continues the client's ``traceparent`` and carries the GenAI + route attributes."""
import pytest

from tests.deployments.harness import Client, fake_args
from tests.telemetry.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.ray
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_router_span_continues_client_trace(serve_shared):
    with OtlpReceiver() as receiver:
        args = fake_args(telemetry={"otlp_endpoint": receiver.endpoint, "sampling_ratio": 0.0,
                                    "service_name": "specserve-e2e"},
                         engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine", "options": {}})
        # BatchSpanProcessor exports every 5 s by default; the shared session's replicas flush
        # every 200 ms (harness.SHARED_ENV)
        with serve_shared.apps({"traced": args}) as addrs:
            client = Client(addrs.grpc, "traced")
            client.wait_ready()
            md = [("traceparent", f"00-{TRACE_ID}-{PARENT}-01")]
            resp = client.generate(md=md, prompt="hello world", max_tokens=6, temperature=0.0, segment="code")
            client.generate(prompt="not sampled: ratio 0 and no parent", max_tokens=2)
            spans = receiver.wait_for(lambda s: any(x.trace_id == TRACE_ID and x.name.startswith("text_completion")
                                                    for x in s), timeout=60)
    router = next(x for x in spans if x.trace_id == TRACE_ID and x.name.startswith("text_completion"))
    assert router.parent_span_id == PARENT and router.service_name == "specserve-e2e"
    a = router.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.usage.output_tokens"] == len(resp.token_ids)
    assert a["specserve.route.path"] in ("speculative", "plain")
    assert a["specserve.route.reason"] and a["specserve.segment"] == "code"
    assert all(x.trace_id == TRACE_ID for x in spans)  # the unsampled request exported nothing
