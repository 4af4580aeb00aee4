"""MoE probes through the service: a real Ray Serve app (fake engine flagged MoE, gate closed)
behind the gRPC proxy. 1 in ``moe.probe_every`` requests of a closed segment goes to the
SpecEngine as a probe (route reason ``probe_moe_unvalidated``), the rest stay plain, counted per
segment, and every answer is the same text."""
from __future__ import annotations

import pytest

from tests.deployments.harness import Client, fake_args

pytestmark = pytest.mark.ray

PLAIN, SPEC = 2, 1  # specserve.v1.Path


def test_closed_moe_segment_probes_every_nth_request(serve_shared):
    args = fake_args(engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine", "options": {"moe": True}},
                     moe={"probe_every": 3})
    with serve_shared.apps({"moe": args}) as addrs:
        c = Client(addrs.grpc, "moe")
        c.wait_ready()  # the health check refreshes the Router's view of the engines (MoE, gate closed)
        routes, outputs = [], set()
        for segment in ["chat"] * 3 + ["code"] * 2 + ["chat"] * 3 + ["code"]:
            r = c.generate(prompt="probe me", max_tokens=6, segment=segment)
            routes.append((segment, r.route.path, r.route.reason, r.spec.draft_tokens > 0))
            outputs.add(tuple(r.token_ids))
        gated = (PLAIN, "moe_unvalidated", False)
        probe = (SPEC, "probe_moe_unvalidated", True)  # the fake SpecEngine drafts for it
        assert routes == [("chat", *gated), ("chat", *gated), ("chat", *probe),
                          ("code", *gated), ("code", *gated),
                          ("chat", *gated), ("chat", *gated), ("chat", *probe),
                          ("code", *probe)]
        assert len(outputs) == 1  # same answer on either path
