"""Per-segment settings through a real Serve app (FakeEngine): the Router reads
``router.segments`` from the app config — a segment gated by its own min_alpha goes plain once its
α is measured while the others speculate — the SpecEngine drafts a segment's requests at the
segment's own K, and ModelInfo shows the settings in force (drafter and K policy included)."""
from __future__ import annotations

import time

import pytest

from tests.deployments.harness import Client, fake_args

pytestmark = pytest.mark.ray

ARGS = fake_args(router={"enter_threshold": 2, "exit_threshold": 4, "min_alpha": 0.3, "min_alpha_samples": 8,
                         "probe_every": 0, "plain_when_faster": False,
                         "segments": {"json": {"min_alpha": 1.0}, "chat": {"exit_threshold": 6, "drafter": "suffix"},
                                      "code": {"num_draft_tokens": 2}}},
                 engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine", "options": {"token_delay_s": 0.005}})


def test_router_and_engine_apply_and_model_info_shows_per_segment_settings(serve_shared):
    with serve_shared.apps({"seg": ARGS}) as addrs:
        c = Client(addrs.grpc, "seg")
        c.wait_ready()
        info = c.stub.ModelInfo(c.pb2.ModelInfoRequest(), metadata=c.md, timeout=10)
        got = {s.segment: (s.enter_threshold, s.exit_threshold, round(s.min_alpha, 3), s.min_alpha_auto,
                           s.drafter, s.num_draft_tokens, s.own_drafter, s.own_num_draft_tokens)
               for s in info.segment_routing}
        assert got == {"chat": (2, 6, 0.3, False, "suffix", "4", True, False),
                       "code": (2, 4, 0.3, False, "ngram", "2", False, True),
                       "json": (2, 4, 1.0, False, "ngram", "4", False, False)}
        assert (info.enter_threshold, info.exit_threshold) == (2, 4)
        # α 0.75 for every segment (the fake's default): json's own min_alpha 1.0 gates it once the
        # SpecEngine has measured 8 of its draft tokens; code (global 0.3) keeps speculating
        first = c.generate(prompt="json please", max_tokens=8, segment="json")
        assert first.route.reason == "below_enter_threshold"  # not measured yet
        deadline = time.monotonic() + 30
        while True:
            r = c.generate(prompt="json please", max_tokens=8, segment="json")
            if r.route.reason == "below_break_even" or time.monotonic() > deadline:
                break
            time.sleep(0.3)  # the Router polls the engines' α every 0.5 s
        assert r.route.reason == "below_break_even"
        code = c.generate(prompt="code please", max_tokens=8, segment="code")
        assert code.route.reason == "below_enter_threshold" and code.spec.draft_tokens > 0
        assert code.spec.draft_tokens == 2 * code.spec.drafts  # code's own K
        other = c.generate(prompt="other please", max_tokens=8, segment="other")
        assert other.spec.drafts and other.spec.draft_tokens == 4 * other.spec.drafts  # the global K
