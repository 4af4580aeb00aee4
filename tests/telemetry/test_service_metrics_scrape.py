"""Metrics of a real Serve app (fake engine, placement ``separate`` with the n-gram drafter in a
DraftServer), scraped over HTTP from Ray's Prometheus endpoint (``_metrics_export_port`` on
127.0.0.1) after a few requests: requests by path and reason, TTFT/TPOT histograms, acceptance per
segment and position, chosen K, draft fallbacks and resyncs (the DraftServer is killed once),
queue depth and KV pool usage.

Ray's metrics agent exports on its own schedule (every 2 s here): every expectation is polled with
a deadline.
"""
from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.deployments.harness import SMALL, Client, fake_args, free_port, serve_apps
from tests.deployments.test_service_fake import _kill_draft_server, engine_stats, wait_for

pytestmark = pytest.mark.ray
PROMPT = "one two three one two three "
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> (name, labels, value) samples."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and not line.startswith("#"):
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def series(samples, name: str, **labels) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for n, lab, v in samples
            if n == name and all(lab.get(k) == want for k, want in labels.items())]


def total(samples, name: str, **labels) -> float:
    return sum(v for _, v in series(samples, name, **labels))


def _idle_gauges(samples) -> bool:
    """Gauges are exported periodically: wait until the last export shows the idle state."""
    inflight = series(samples, "ray_specserve_inflight", path="speculative")
    gauges = [series(samples, name, engine=e) for name in ("ray_specserve_queue_depth", "ray_specserve_running_requests")
              for e in ("spec", "batch")]
    return bool(inflight) and inflight[0][1] == 0 and all(g and g[0][1] == 0 for g in gauges)


@pytest.fixture(scope="module")
def scraped():
    """Drive a few requests (spec and plain, then a DraftServer kill), then poll the scrape until
    every expected series has arrived; return the final samples and the engine stats."""
    port = free_port()
    # max_sequences=1: two concurrent sequences evict each other on the DraftServer -> resyncs
    args = fake_args(placement="separate", draft_server={**SMALL, "host": "127.0.0.1", "max_sequences": 1},
                     engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine",
                                  "options": {"token_delay_s": 0.005}})
    # Ray's processes export their metrics every 2 s instead of every 10 s: what they export is
    # the same, the polls below see it sooner (gauges live two intervals: the engines set theirs
    # every 2 s)
    with serve_apps({"sep": args}, ray_kwargs={"_metrics_export_port": port,
                                              "_system_config": {"metrics_report_interval_ms": 2000}}) as addr:
        c = Client(addr, "sep")
        c.wait_ready()
        for _ in range(3):
            r = c.generate(prompt=PROMPT, max_tokens=24, segment="code")  # AUTO -> speculative
            assert r.route.path == 1 and r.route.reason == "below_enter_threshold"
            assert r.spec.accepted_tokens > 0
        for _ in range(2):
            r = c.generate(prompt=PROMPT, max_tokens=12, mode=2, segment="chat")  # PLAIN
            assert r.route.path == 2 and r.route.reason == "mode_plain"
        with ThreadPoolExecutor(2) as pool:  # two at once: each evicts the other's prefix -> resyncs
            outs = list(pool.map(lambda p: list(c.stream(prompt=p, max_tokens=32, segment="code")),
                                 [PROMPT, "four five six four five six "]))
        assert all(chunks[-1].finished and chunks[0].route.path == 1 for chunks in outs)
        assert engine_stats("sep", "SpecEngine")["draft_resyncs"] >= 1
        # Draft side gone: the engine continues without speculation (fallbacks).
        _kill_draft_server()
        c.generate(prompt=PROMPT, max_tokens=24, segment="code")
        wait_for(lambda: c.generate(prompt=PROMPT, max_tokens=24, segment="code").spec.drafts > 0,
                 timeout=90, what="speculation to resume on the new DraftServer")
        stats = engine_stats("sep", "SpecEngine")
        assert stats["draft_fallbacks"] >= 1 and stats["draft_resyncs"] >= 1

        def have_all(samples) -> bool:
            return (total(samples, "ray_specserve_requests_total", path="speculative") >= 4
                    and total(samples, "ray_specserve_requests_total", path="plain") >= 2
                    and series(samples, "ray_specserve_ttft_seconds_count")
                    and series(samples, "ray_specserve_tpot_seconds_count")
                    and total(samples, "ray_specserve_draft_fallbacks_total") >= stats["draft_fallbacks"]
                    and total(samples, "ray_specserve_draft_resyncs_total") >= stats["draft_resyncs"]
                    and total(samples, "ray_specserve_spec_draft_tokens_total", segment="code")
                    >= stats["spec_by_segment"]["code"]["draft_tokens"]
                    and series(samples, "ray_specserve_spec_steps_by_num_draft_tokens_total")
                    and series(samples, "ray_specserve_kv_usage_ratio", engine="spec")
                    and series(samples, "ray_specserve_queue_depth", engine="spec")
                    and _idle_gauges(samples))

        deadline = time.monotonic() + 60
        samples: list = []
        while time.monotonic() < deadline:
            try:
                samples = scrape(port)
            except OSError:
                samples = []
            if have_all(samples):
                break
            time.sleep(0.5)
        names = sorted({n for n, _, _ in samples if "specserve" in n})
        assert have_all(samples), f"expected series not scraped within 60 s; have {names}"
        yield samples, stats


def test_requests_by_path_and_reason(scraped):
    samples, _ = scraped
    spec = series(samples, "ray_specserve_requests_total", path="speculative", reason="below_enter_threshold")
    plain = series(samples, "ray_specserve_requests_total", path="plain", reason="mode_plain")
    assert sum(v for lab, v in spec if lab["segment"] == "code") >= 4
    assert sum(v for lab, v in plain if lab["segment"] == "chat") == 2
    assert {lab["finish_reason"] for lab, _ in spec + plain} <= {"length", "eos", "stop"}
    # The Router's own decision counter agrees with the request counter.
    assert total(samples, "ray_specserve_route_decisions_total", path="plain", reason="mode_plain") == 2
    assert series(samples, "ray_specserve_requests_total")[0][0]["deployment"] == "Router"


def test_latency_histograms(scraped):
    samples, _ = scraped
    for name in ("ray_specserve_ttft_seconds", "ray_specserve_tpot_seconds", "ray_specserve_e2e_seconds"):
        for path, n in (("speculative", 4), ("plain", 2)):
            assert total(samples, f"{name}_count", path=path) >= n, name
            s = total(samples, f"{name}_sum", path=path)
            assert 0 < s < 60 * total(samples, f"{name}_count", path=path), name
        buckets = series(samples, f"{name}_bucket", path="plain")
        inf = [v for lab, v in buckets if lab["le"] in ("+Inf", "inf")]
        assert inf and inf[0] == total(samples, f"{name}_count", path="plain")
    # fake engine: >= 5 ms per token, so TPOT lies between 1 ms and 1 s
    tpot_mean = total(samples, "ray_specserve_tpot_seconds_sum") / total(samples, "ray_specserve_tpot_seconds_count")
    assert 0.001 < tpot_mean < 1.0


def test_acceptance_per_segment_position_and_chosen_k(scraped):
    samples, stats = scraped
    code = stats["spec_by_segment"]["code"]
    alpha = series(samples, "ray_specserve_spec_acceptance_rate", engine="spec", segment="code")
    assert alpha and 0.0 < alpha[0][1] <= 1.0
    drafted = total(samples, "ray_specserve_spec_draft_tokens_total", engine="spec", segment="code")
    accepted = total(samples, "ray_specserve_spec_accepted_tokens_total", engine="spec", segment="code")
    assert drafted == code["draft_tokens"] and accepted == code["accepted_tokens"] and 0 < accepted <= drafted
    assert alpha[0][1] == pytest.approx(accepted / drafted, rel=1e-6)
    pos = series(samples, "ray_specserve_spec_position_acceptance_rate", engine="spec", segment="code")
    assert pos and all(0.0 <= v <= 1.0 for _, v in pos) and {lab["position"] for lab, _ in pos} >= {"0"}
    num_draft_tokens = series(samples, "ray_specserve_spec_steps_by_num_draft_tokens_total", engine="spec", segment="code")
    assert num_draft_tokens and all(0 <= int(lab["num_draft_tokens"]) <= 4 for lab, _ in num_draft_tokens)  # num_draft_tokens=4
    assert sum(v for lab, v in num_draft_tokens if lab["num_draft_tokens"] != "0") == code["drafts"]  # steps that drafted
    # per-request α histogram at the router
    assert total(samples, "ray_specserve_request_acceptance_rate_count", segment="code") >= 4
    assert "chat" not in {lab["segment"] for lab, _ in series(samples, "ray_specserve_spec_draft_tokens_total")}


def test_draft_fallbacks_and_resyncs(scraped):
    samples, stats = scraped
    assert total(samples, "ray_specserve_draft_fallbacks_total", engine="spec") == stats["draft_fallbacks"] >= 1
    assert total(samples, "ray_specserve_draft_resyncs_total", engine="spec") == stats["draft_resyncs"] >= 1


def test_queue_depth_and_kv_pool(scraped):
    samples, stats = scraped
    for engine in ("spec", "batch"):
        q = series(samples, "ray_specserve_queue_depth", engine=engine)
        assert q and q[0][1] == 0  # idle after the requests
        running = series(samples, "ray_specserve_running_requests", engine=engine)
        assert running and running[0][1] == 0
        cap = series(samples, "ray_specserve_kv_blocks_capacity", engine=engine)
        free = series(samples, "ray_specserve_kv_blocks_free", engine=engine)
        usage = series(samples, "ray_specserve_kv_usage_ratio", engine=engine)
        assert cap and cap[0][1] > 0 and free and 0 <= free[0][1] <= cap[0][1]
        assert usage and 0.0 <= usage[0][1] <= 1.0
        assert usage[0][1] == pytest.approx(1 - free[0][1] / cap[0][1])
    assert series(samples, "ray_specserve_kv_blocks_capacity", engine="spec")[0][1] == stats["kv_blocks_total"]
    inflight = series(samples, "ray_specserve_inflight", path="speculative")
    assert inflight and inflight[0][1] == 0  # every speculative request has left the router
