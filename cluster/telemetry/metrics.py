"""The ``specserve_*`` metrics and the two calls that feed them.

Owns: metric names, labels and buckets; ``record_request`` (router, once per finished request:
path/reason counts, TTFT, TPOT, end-to-end latency, tokens, per-request α and acceptance rate) and
``record_engine_stats`` (engine replica, periodically: queue depth, running, KV pool, draft
fallbacks/resyncs, break-even α, and per segment: α — lifetime and the live one the Router gates
on —, acceptance rate, acceptance per position, chosen K, drafted/accepted tokens, rejections).
Ignores: where the numbers come from and how they are exposed (``metrics_backend``).

Names say which quantity they carry (``cluster.speculative.acceptance``): ``*_alpha`` is α per
position, accepted / (accepted + rejections), the unit of the cost model and of the Router's and
MoE gates; ``*_acceptance_rate`` is accepted / drafted (descriptive, biased low as an α).

EngineStats carries cumulative totals; counters are fed the positive difference since the last
export of the same engine (a drop means the engine restarted: the new total is counted afresh).
Segments are a client-supplied label: at most ``max_segments`` distinct values are kept, the rest
report as ``other`` (bounded Prometheus cardinality; ``cluster.common.segments``).

Metric (Prometheus name; inside Ray prefixed ``ray_``)      labels
specserve_requests_total                                   path, reason, segment, finish_reason, api
specserve_ttft_seconds / _tpot_seconds / _e2e_seconds      path, segment        (histograms)
specserve_prompt_tokens_total / _output_tokens_total       path
specserve_request_alpha / _request_acceptance_rate        segment              (histograms, per request)
specserve_inflight                                         path                 (gauge, router)
specserve_queue_depth / _running_requests                  engine               (gauges)
specserve_kv_blocks_free / _kv_blocks_capacity / _kv_usage_ratio  engine           (gauges)
specserve_preemptions_total / _draft_fallbacks_total / _draft_resyncs_total  engine
specserve_spec_break_even_alpha                            engine               (gauge, adaptive K)
specserve_spec_alpha / _spec_live_alpha                    engine, segment      (gauges: lifetime, gated on)
specserve_spec_class_live_alpha                            engine, segment, class (gauge: each acceptance
                                                           class's, gated on once measured: base, sampled,
                                                           shaped, sampled+shaped)
specserve_spec_acceptance_rate                             engine, segment      (gauge, accepted / drafted)
specserve_spec_position_acceptance_rate                    engine, segment, position (gauge)
specserve_spec_draft_tokens_total / _accepted_tokens_total engine, segment
specserve_spec_rejections_total                            engine, segment      (steps that rejected a draft)
specserve_spec_position_drafted_total / _accepted_total    engine, segment, position
specserve_spec_steps_by_num_draft_tokens_total            engine, segment, num_draft_tokens (steps per K)
specserve_drafter_steps_total / _drafter_draft_tokens_total / _drafter_accepted_tokens_total
                                                           engine, drafter      (a portfolio's members,
                                                           and "prediction": requests' predicted outputs)
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from cluster.common.acceptance_class import CLASS_NAMES
from cluster.common.segments import DEFAULT_SEGMENT, SegmentLabels
from cluster.telemetry.metrics_backend import PrometheusBackend, RayBackend, make_backend
from cluster.telemetry.request_span import label

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(slots=True)
class MetricsConfig:
    backend: str = "auto"  # auto | ray | prometheus
    max_segments: int = 32

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "ray", "prometheus"):
            raise ValueError(f"metrics backend must be auto, ray or prometheus, got {self.backend!r}")
        if self.max_segments < 1:
            raise ValueError("max_segments must be >= 1")


class SpecserveMetrics:
    """One per process (router and engine replicas alike); cheap to create."""

    def __init__(self, config: MetricsConfig | None = None) -> None:
        self.config = config or MetricsConfig()
        self.backend: PrometheusBackend | RayBackend = make_backend(self.config.backend)
        b = self.backend
        self._segments = SegmentLabels(self.config.max_segments)
        self._last: dict[tuple, float] = {}
        # Router side.
        self.requests = b.counter("specserve_requests", "Finished requests by route path, route reason, "
                                  "segment, finish reason and front end (api: grpc | openai)",
                                  ("path", "reason", "segment", "finish_reason", "api"))
        self.ttft = b.histogram("specserve_ttft_seconds", "Time to first token seen by the router",
                                ("path", "segment"), LATENCY_BUCKETS)
        self.tpot = b.histogram("specserve_tpot_seconds", "Time per output token after the first",
                                ("path", "segment"), TPOT_BUCKETS)
        self.e2e = b.histogram("specserve_e2e_seconds", "End-to-end request latency at the router",
                               ("path", "segment"), LATENCY_BUCKETS)
        self.prompt_tokens = b.counter("specserve_prompt_tokens", "Prompt tokens", ("path",))
        self.output_tokens = b.counter("specserve_output_tokens", "Generated tokens", ("path",))
        self.request_alpha = b.histogram("specserve_request_alpha",
                                         "Per-request alpha: per-position acceptance probability, accepted / "
                                         "(accepted + rejections) (requests that drafted)", ("segment",), RATIO_BUCKETS)
        self.request_acceptance_rate = b.histogram("specserve_request_acceptance_rate",
                                                   "Per-request acceptance rate: accepted / drafted draft tokens "
                                                   "(requests that drafted)", ("segment",), RATIO_BUCKETS)
        self.inflight = b.gauge("specserve_inflight", "In-flight requests per route path", ("path",))
        # Engine side.
        self.queue_depth = b.gauge("specserve_queue_depth", "Requests waiting for admission", ("engine",))
        self.running = b.gauge("specserve_running_requests", "Requests in the running batch", ("engine",))
        self.kv_free = b.gauge("specserve_kv_blocks_free", "Free KV cache blocks", ("engine",))
        self.kv_total = b.gauge("specserve_kv_blocks_capacity", "KV cache blocks in the pool", ("engine",))
        self.kv_usage = b.gauge("specserve_kv_usage_ratio", "Used fraction of the KV pool", ("engine",))
        self.preemptions = b.counter("specserve_preemptions", "Preempted sequences", ("engine",))
        self.prefix_queries = b.counter("specserve_prefix_cache_queries", "Full prompt blocks looked up in the "
                                        "prefix cache at admission", ("engine",))
        self.prefix_hits = b.counter("specserve_prefix_cache_hits", "Full prompt blocks found in the prefix "
                                     "cache (a block of prefill saved each)", ("engine",))
        self.fallbacks = b.counter("specserve_draft_fallbacks", "Sequences that continued without "
                                   "speculation because the draft side failed", ("engine",))
        self.resyncs = b.counter("specserve_draft_resyncs", "KVSync resyncs (draft lacked the prefix)",
                                 ("engine",))
        self.break_even_alpha = b.gauge("specserve_spec_break_even_alpha",
                                        "Per-position alpha at which speculating pays under the measured "
                                        "step costs (the Router's default min_alpha)", ("engine",))
        self.alpha = b.gauge("specserve_spec_alpha", "Alpha (per-position acceptance probability, "
                             "cumulative) per segment", ("engine", "segment"))
        self.live_alpha = b.gauge("specserve_spec_live_alpha", "Live alpha per segment (per position, decayed "
                                  "by draft tokens): what the Router compares with min_alpha", ("engine", "segment"))
        self.class_live_alpha = b.gauge("specserve_spec_class_live_alpha", "Live alpha per segment and "
                                        "acceptance class (base, sampled, shaped, sampled+shaped): what the "
                                        "Router compares with min_alpha once the class is measured",
                                        ("engine", "segment", "class"))
        self.acceptance_rate = b.gauge("specserve_spec_acceptance_rate", "Acceptance rate: accepted / drafted "
                                       "draft tokens (cumulative) per segment", ("engine", "segment"))
        self.position_acceptance_rate = b.gauge(
            "specserve_spec_position_acceptance_rate", "Share of the steps that drafted position i in which "
            "positions 0..i were all accepted (cumulative) per segment", ("engine", "segment", "position"))
        self.draft_tokens = b.counter("specserve_spec_draft_tokens", "Draft tokens proposed",
                                      ("engine", "segment"))
        self.accepted_tokens = b.counter("specserve_spec_accepted_tokens", "Draft tokens accepted",
                                         ("engine", "segment"))
        self.rejections = b.counter("specserve_spec_rejections", "Verification steps that rejected a draft "
                                    "token (alpha = accepted / (accepted + rejections))", ("engine", "segment"))
        self.pos_drafted = b.counter("specserve_spec_position_drafted", "Draft tokens proposed at position i",
                                     ("engine", "segment", "position"))
        self.pos_accepted = b.counter("specserve_spec_position_accepted", "Draft tokens accepted at position i",
                                      ("engine", "segment", "position"))
        self.steps_by_num_draft_tokens = b.counter(
            "specserve_spec_steps_by_num_draft_tokens", "Verification steps by the K chosen (0 = plain step)",
            ("engine", "segment", "num_draft_tokens"))
        self.drafter_counts = {  # EngineStats.drafter_steps' keys -> counters
            key: b.counter(f"specserve_drafter_{key}", f"{what} by the drafter that drafted them (a portfolio's "
                           "members; 'prediction': requests' predicted outputs)", ("engine", "drafter"))
            for key, what in (("steps", "Verification steps"), ("draft_tokens", "Draft tokens"),
                              ("accepted_tokens", "Accepted draft tokens"))}

    # --- helpers ---------------------------------------------------------------------------
    def segment(self, segment: str | None) -> str:
        return self._segments.label(segment or DEFAULT_SEGMENT)

    def _delta(self, counter: Any, tags: dict[str, str], total: float, key: tuple = ()) -> None:
        """Feed ``counter`` the growth of a cumulative ``total``. ``key`` identifies the source
        series (the raw segment name: several segments may share the ``other`` label)."""
        key = (id(counter), tuple(sorted(tags.items())), key)
        last = self._last.get(key, 0.0)
        self._last[key] = total
        diff = total - last if total >= last else total  # drop: engine restarted
        counter.inc(diff, tags)

    # --- router ----------------------------------------------------------------------------
    def record_request(self, output: Any, *, path: Any, reason: Any, segment: str | None,
                       ttft_s: float | None, e2e_s: float, api: str = "grpc") -> None:
        """A finished request: ``output`` is the final RequestOutput (usage, finish reason, spec);
        ``api``: the front end it came through."""
        self.record_request_values(api=api,
            path=path, reason=reason, segment=segment, finish_reason=output.finish_reason,
            num_prompt_tokens=output.num_prompt_tokens, num_output_tokens=output.num_output_tokens,
            ttft_s=ttft_s, e2e_s=e2e_s, spec=getattr(output, "spec", None))

    def record_request_values(self, *, path: Any, reason: Any, segment: str | None, finish_reason: Any,
                              num_prompt_tokens: int, num_output_tokens: int, ttft_s: float | None,
                              e2e_s: float, spec: Any = None, api: str = "grpc") -> None:
        p, seg = label(path), self.segment(segment)
        self.requests.inc(1, {"path": p, "reason": label(reason), "segment": seg,
                              "finish_reason": label(finish_reason) or "unknown", "api": api})
        ps = {"path": p, "segment": seg}
        if ttft_s is not None:
            self.ttft.observe(ttft_s, ps)
            if num_output_tokens > 1:
                self.tpot.observe(max(e2e_s - ttft_s, 0.0) / (num_output_tokens - 1), ps)
        self.e2e.observe(e2e_s, ps)
        self.prompt_tokens.inc(num_prompt_tokens, {"path": p})
        self.output_tokens.inc(num_output_tokens, {"path": p})
        if spec is not None and spec.draft_tokens:
            self.request_alpha.observe(spec.alpha, {"segment": seg})
            self.request_acceptance_rate.observe(spec.acceptance_rate, {"segment": seg})

    def record_unfinished(self, *, path: Any, reason: Any, segment: str | None, finish_reason: str,
                          api: str = "grpc") -> None:
        """A request that ended without a final output (rejected before routing: path ``none`` and
        reason = the error type, e.g. ``INVALID_ARGUMENT``; or failed/cancelled mid-way)."""
        self.requests.inc(1, {"path": label(path) or "none", "reason": label(reason) or "unknown",
                              "segment": self.segment(segment), "finish_reason": finish_reason, "api": api})

    def set_inflight(self, path: Any, value: int) -> None:
        self.inflight.set(value, {"path": label(path)})

    # --- engine ----------------------------------------------------------------------------
    def record_engine_stats(self, stats: Any, engine: str) -> None:
        """Export one ``EngineStats`` snapshot (or its ``to_dict()``, as the engine deployments'
        ``stats()`` returns) of engine ``engine`` ("spec", "batch", ...)."""
        if isinstance(stats, Mapping):
            if "kv_blocks_total" not in stats:
                return  # engine not ready yet: nothing to export
            stats = _StatsView(stats)
        e = {"engine": engine}
        self.queue_depth.set(stats.num_waiting, e)
        self.running.set(stats.num_running, e)
        self.kv_free.set(stats.kv_blocks_free, e)
        self.kv_total.set(stats.kv_blocks_total, e)
        if stats.kv_blocks_total:
            self.kv_usage.set(1.0 - stats.kv_blocks_free / stats.kv_blocks_total, e)
        self._delta(self.preemptions, e, stats.num_preemptions)
        self._delta(self.prefix_queries, e, getattr(stats, "prefix_cache_queries", 0))
        self._delta(self.prefix_hits, e, getattr(stats, "prefix_cache_hits", 0))
        self._delta(self.fallbacks, e, stats.draft_fallbacks)
        self._delta(self.resyncs, e, stats.draft_resyncs)
        if stats.break_even_alpha is not None:
            self.break_even_alpha.set(stats.break_even_alpha, e)
        for drafter, counts in (stats.drafter_steps or {}).items():  # a few fixed names
            for key, counter in self.drafter_counts.items():
                self._delta(counter, {"engine": engine, "drafter": drafter}, counts.get(key, 0))
        for segment, d in stats.spec_by_segment.items():
            es = {"engine": engine, "segment": self.segment(segment)}
            drafted, accepted = d.get("draft_tokens", 0), d.get("accepted_tokens", 0)
            if drafted:
                self.alpha.set(d["alpha"], es)
                self.acceptance_rate.set(accepted / drafted, es)
            if d.get("live_alpha") is not None:
                self.live_alpha.set(d["live_alpha"], es)
            for name, c in (d.get("live_alpha_by_class") or {}).items():
                if name in CLASS_NAMES:  # a fixed few
                    self.class_live_alpha.set(c["live_alpha"], {**es, "class": name})
            raw = (segment,)
            self._delta(self.draft_tokens, es, drafted, raw)
            self._delta(self.accepted_tokens, es, accepted, raw)
            self._delta(self.rejections, es, d.get("rejections", 0), raw)
            for i, (n_d, n_a) in enumerate(zip(d.get("drafted_per_position", ()), d.get("accepted_per_position", ()))):
                esp = {**es, "position": str(i)}
                if n_d:
                    self.position_acceptance_rate.set(n_a / n_d, esp)
                self._delta(self.pos_drafted, esp, n_d, raw)
                self._delta(self.pos_accepted, esp, n_a, raw)
            for k, n in enumerate(d.get("steps_by_num_draft_tokens", ())):
                self._delta(self.steps_by_num_draft_tokens, {**es, "num_draft_tokens": str(k)}, n, raw)


class _StatsView:
    """Attribute access over an ``EngineStats.to_dict()`` mapping."""

    __slots__ = ("_d",)

    def __init__(self, d: Mapping[str, Any]) -> None:
        self._d = d

    def __getattr__(self, name: str) -> Any:
        d = self._d
        if name in ("spec_by_segment", "drafter_steps"):
            return d.get(name) or {}
        return d.get(name, 0)


async def export_engine_stats_forever(metrics: SpecserveMetrics, stats: Callable[[], Any], engine: str,
                                      period_s: float = 2.0) -> None:
    """Background task for an engine deployment: export ``stats()`` every ``period_s`` seconds."""
    if period_s <= 0:
        raise ValueError("period_s must be > 0")
    log = logging.getLogger("specserve.telemetry")
    while True:
        try:
            metrics.record_engine_stats(stats(), engine)
        except Exception:  # noqa: BLE001 - metrics must never take the replica down
            log.exception("engine stats export failed")
        await asyncio.sleep(period_s)
