"""Router policy rules and hysteresis, without Ray."""
import math

import pytest

from cluster.common.request import SpecMode
from cluster.routing.policy import EngineView, Path, RequestFeatures, RouteReason, RouterConfig, RouterPolicy

SPEC, PLAIN = Path.SPECULATIVE, Path.PLAIN


def decide(policy, in_flight=0, **kw):
    view_kw = {k: kw.pop(k) for k in list(kw) if k in ("spec_available", "moe", "moe_gate_open",
                                                        "alpha_by_segment", "alpha_by_class", "break_even_alpha",
                                                        "moe_open_segments")}
    d = policy.decide(RequestFeatures(**kw), EngineView(spec_in_flight=in_flight, **view_kw))
    return d.path, d.reason


def test_hysteresis_walk():
    p = RouterPolicy(RouterConfig(enter_threshold=2, exit_threshold=4))
    # in-flight sequence of a burst rising and falling, with the expected decision at each point
    table = [
        (0, SPEC, RouteReason.BELOW_ENTER_THRESHOLD),
        (1, SPEC, RouteReason.BELOW_ENTER_THRESHOLD),
        (2, SPEC, RouteReason.HYSTERESIS_SPECULATIVE),
        (3, SPEC, RouteReason.HYSTERESIS_SPECULATIVE),
        (4, PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD),
        (5, PLAIN, RouteReason.HYSTERESIS_PLAIN),
        (3, PLAIN, RouteReason.HYSTERESIS_PLAIN),
        (2, PLAIN, RouteReason.HYSTERESIS_PLAIN),
        (1, SPEC, RouteReason.BELOW_ENTER_THRESHOLD),
        (3, SPEC, RouteReason.HYSTERESIS_SPECULATIVE),
    ]
    for in_flight, path, reason in table:
        assert decide(p, in_flight) == (path, reason), in_flight


def test_mode_overrides_and_hysteresis_state_untouched():
    p = RouterPolicy(RouterConfig(enter_threshold=1, exit_threshold=2))
    assert decide(p, 100, mode=SpecMode.SPECULATIVE) == (SPEC, RouteReason.MODE_SPECULATIVE)
    assert decide(p, 0, mode=SpecMode.PLAIN) == (PLAIN, RouteReason.MODE_PLAIN)
    assert p.spec_open  # overrides never flip the hysteresis bit


def test_a_scoring_request_goes_plain_unless_its_mode_says_otherwise():
    """max_tokens 0 generates nothing, so there is nothing to draft: AUTO sends it to the
    BatchEngine (an idle SpecEngine too), an explicit mode is the client's."""
    p = RouterPolicy(RouterConfig(enter_threshold=2, exit_threshold=4))
    assert decide(p, 0, scoring=True) == (PLAIN, RouteReason.SCORING)
    assert decide(p, 0, scoring=True, mode=SpecMode.SPECULATIVE) == (SPEC, RouteReason.MODE_SPECULATIVE)
    assert decide(p, 0, scoring=True, mode=SpecMode.PLAIN) == (PLAIN, RouteReason.MODE_PLAIN)
    assert decide(p, 0) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD) and p.spec_open  # the bit untouched


def test_constrained_routes_like_any_request_by_default():
    p = RouterPolicy(RouterConfig(enter_threshold=2, exit_threshold=4))
    assert decide(p, constrained=True) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)
    assert decide(p, 5, constrained=True) == (PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD)
    assert decide(p, constrained=True, mode=SpecMode.SPECULATIVE) == (SPEC, RouteReason.MODE_SPECULATIVE)
    assert decide(p, constrained=True, mode=SpecMode.PLAIN) == (PLAIN, RouteReason.MODE_PLAIN)


def test_constrained_goes_plain_when_grammar_speculation_is_off():
    p = RouterPolicy(RouterConfig(grammar_speculation=False))
    assert decide(p, constrained=True) == (PLAIN, RouteReason.CONSTRAINED)
    assert decide(p, constrained=True, mode=SpecMode.SPECULATIVE) == (PLAIN, RouteReason.CONSTRAINED)
    assert decide(p) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)


def test_moe_gate_and_unavailable_spec():
    p = RouterPolicy(RouterConfig())
    assert decide(p, moe=True, moe_gate_open=False) == (PLAIN, RouteReason.MOE_UNVALIDATED)
    assert decide(p, moe=True, moe_gate_open=False, mode=SpecMode.SPECULATIVE) == (
        PLAIN, RouteReason.MOE_UNVALIDATED)
    assert decide(p, moe=True, moe_gate_open=True) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)
    assert decide(p, spec_available=False) == (PLAIN, RouteReason.SPEC_UNAVAILABLE)


MOE_PLAIN = (PLAIN, RouteReason.MOE_UNVALIDATED)
MOE_PROBE = (SPEC, RouteReason.PROBE_MOE_UNVALIDATED)


def test_closed_moe_segment_is_probed_every_nth_per_segment():
    p = RouterPolicy(RouterConfig(moe_probe_every=3))
    closed = {"moe": True, "moe_gate_open": False}
    # (segment, mode, expected): each segment counts its own requests; an explicit SPECULATIVE
    # wish is gated like AUTO (and may be the probe); PLAIN never counts
    table = [
        ("chat", SpecMode.AUTO, MOE_PLAIN),
        ("chat", SpecMode.SPECULATIVE, MOE_PLAIN),
        ("code", SpecMode.AUTO, MOE_PLAIN),
        ("chat", SpecMode.PLAIN, (PLAIN, RouteReason.MODE_PLAIN)),
        ("chat", SpecMode.AUTO, MOE_PROBE),
        ("code", SpecMode.AUTO, MOE_PLAIN),
        ("chat", SpecMode.AUTO, MOE_PLAIN),
        ("code", SpecMode.SPECULATIVE, MOE_PROBE),
        ("chat", SpecMode.AUTO, MOE_PLAIN),
        ("chat", SpecMode.AUTO, MOE_PROBE),
    ]
    for i, (segment, mode, expected) in enumerate(table):
        assert decide(p, segment=segment, mode=mode, **closed) == expected, (i, segment, mode)


def test_moe_probe_respects_the_spec_engines_load_and_can_be_off():
    p = RouterPolicy(RouterConfig(enter_threshold=2, exit_threshold=4, moe_probe_every=1))
    # the SpecEngine is full: a due probe waits for the next due one (stays plain, gate reason)
    assert decide(p, 4, moe=True, moe_gate_open=False) == MOE_PLAIN
    assert decide(p, 1, moe=True, moe_gate_open=False) == MOE_PROBE
    never = RouterPolicy(RouterConfig(moe_probe_every=0))
    assert {decide(never, moe=True, moe_gate_open=False) for _ in range(20)} == {MOE_PLAIN}


def test_moe_segment_opened_by_the_engine_follows_the_usual_rules():
    p = RouterPolicy(RouterConfig(min_alpha=0.5, min_alpha_samples=10, moe_probe_every=100))
    stats = {"chat": {"live_alpha": 0.7, "live_draft_tokens": 300, "moe_gate_open": True},
             "code": {"live_alpha": 0.2, "live_draft_tokens": 300, "moe_gate_open": False}}
    view = EngineView.from_spec_by_segment(stats, moe=True, moe_gate_open=False)
    assert view.moe_open_segments == frozenset({"chat"})

    def route(segment, mode=SpecMode.AUTO):
        d = p.decide(RequestFeatures(mode=mode, segment=segment), view)
        return d.path, d.reason

    assert route("chat") == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)
    assert route("chat", SpecMode.SPECULATIVE) == (SPEC, RouteReason.MODE_SPECULATIVE)
    assert route("code") == MOE_PLAIN  # measured below threshold: still closed
    assert route("new") == MOE_PLAIN  # never probed
    # an opened segment whose α later falls below break-even is gated by rule 6 like any other
    view = EngineView.from_spec_by_segment({"chat": {**stats["chat"], "live_alpha": 0.3}},
                                           moe=True, moe_gate_open=False)
    assert route("chat") == (PLAIN, RouteReason.BELOW_BREAK_EVEN)
    # a dense target's view never gates on MoE, whatever the per-segment flags say
    dense = EngineView.from_spec_by_segment({"x": {"moe_gate_open": False}})
    assert dense.moe_open("x") and dense.moe_open("y")


def test_break_even_per_segment():
    p = RouterPolicy(RouterConfig(min_alpha=0.5, min_alpha_samples=10))
    rows = (("chat", 0.3, 100), ("code", 0.8, 100), ("json", 0.1, 5))
    assert decide(p, segment="chat", alpha_by_segment=rows) == (PLAIN, RouteReason.BELOW_BREAK_EVEN)
    assert decide(p, segment="code", alpha_by_segment=rows)[0] is SPEC
    assert decide(p, segment="json", alpha_by_segment=rows)[0] is SPEC  # too few samples to judge
    assert decide(p, segment="new", alpha_by_segment=rows)[0] is SPEC  # unmeasured segment
    # a request with a prediction drafts from it: its segment's (drafter's) α does not gate it ...
    assert decide(p, segment="chat", alpha_by_segment=rows, predicted=True) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)
    # ... but load does
    busy = RouterPolicy(RouterConfig(min_alpha=0.5, min_alpha_samples=10, enter_threshold=2, exit_threshold=3))
    assert decide(busy, in_flight=5, segment="chat", alpha_by_segment=rows, predicted=True)[0] is PLAIN
    # an explicit SPECULATIVE wish beats the break-even gate (the client asked)
    assert decide(p, segment="chat", mode=SpecMode.SPECULATIVE, alpha_by_segment=rows)[0] is SPEC


def test_auto_min_alpha_is_the_engines_break_even():
    """Default min_alpha "auto": the SpecEngine's measured break-even gates; without one the
    seed's 0.5; an explicit number in the config wins over both."""
    auto = RouterPolicy(RouterConfig(min_alpha_samples=10))
    rows = (("code", 0.3, 100),)
    assert decide(auto, segment="code", alpha_by_segment=rows, break_even_alpha=0.12)[0] is SPEC
    assert decide(auto, segment="code", alpha_by_segment=rows, break_even_alpha=0.35) == (
        PLAIN, RouteReason.BELOW_BREAK_EVEN)
    assert decide(auto, segment="code", alpha_by_segment=rows) == (PLAIN, RouteReason.BELOW_BREAK_EVEN)
    fixed = RouterPolicy(RouterConfig(min_alpha=0.2, min_alpha_samples=10))
    assert decide(fixed, segment="code", alpha_by_segment=rows, break_even_alpha=0.9)[0] is SPEC
    v = EngineView.from_spec_by_segment({}, break_even_alpha=0.2)
    assert auto.min_alpha(v) == 0.2


def test_gated_segment_is_probed_periodically():
    p = RouterPolicy(RouterConfig(min_alpha=0.5, min_alpha_samples=10, probe_every=4))
    rows = (("chat", 0.3, 100),)
    reasons = [decide(p, segment="chat", alpha_by_segment=rows)[1] for _ in range(8)]
    gated, probe = RouteReason.BELOW_BREAK_EVEN, RouteReason.PROBE_BELOW_BREAK_EVEN
    assert reasons == [gated, gated, gated, probe, gated, gated, gated, probe]
    never = RouterPolicy(RouterConfig(min_alpha=0.5, min_alpha_samples=10, probe_every=0))
    assert {decide(never, segment="chat", alpha_by_segment=rows)[1] for _ in range(40)} == {gated}


def test_engine_view_from_stats():
    """The view carries α per position: the live one when the engine has it, else the lifetime
    one — never acceptance_rate (accepted / drafted, another unit than the break-even α)."""
    lifetime = {"acceptance_rate": 0.5, "alpha": 0.7, "draft_tokens": 40}
    v = EngineView.from_spec_by_segment({"code": lifetime}, spec_in_flight=3)
    assert v.alpha("code") == (0.7, 40) and v.alpha("chat") is None and v.spec_in_flight == 3
    v = EngineView.from_spec_by_segment({"code": {**lifetime, "live_alpha": 0.6, "live_draft_tokens": 30}})
    assert v.alpha("code") == (0.6, 30)


def test_each_acceptance_class_is_gated_on_its_own_alpha_once_measured():
    """A segment whose greedy requests pay and whose sampled ones do not: each request is judged
    by its class's α (with ``min_alpha_samples`` measured), probed apart; a class measured less
    (here: shaped) falls back to the segment's α over every class."""
    p = RouterPolicy(RouterConfig(min_alpha=0.3, min_alpha_samples=10, probe_every=3))
    view = dict(alpha_by_segment=(("chat", 0.4, 300),),
                alpha_by_class=(("chat", "base", 0.55, 200), ("chat", "sampled", 0.12, 100), ("chat", "shaped", 0.0, 4)))
    gated, probe = (PLAIN, RouteReason.BELOW_BREAK_EVEN), (SPEC, RouteReason.PROBE_BELOW_BREAK_EVEN)
    sampled = [decide(p, segment="chat", acceptance_class="+sampled", **view) for _ in range(6)]
    assert sampled == [gated, gated, probe, gated, gated, probe]
    assert decide(p, segment="chat", acceptance_class="", **view)[0] is SPEC  # greedy: 0.55
    assert decide(p, segment="chat", acceptance_class="+shaped", **view)[0] is SPEC  # 4 samples: the segment's 0.4
    # a gated class's probes are its own: greedy traffic in between does not use them up
    mixed = [decide(p, segment="chat", acceptance_class=c, **view) for c in ("+sampled", "", "+sampled", "", "+sampled")]
    assert [m[0] for m in mixed] == [PLAIN, SPEC, PLAIN, SPEC, SPEC] and mixed[-1] == probe
    # without class rows (an engine that predates them) every class is judged by the segment's α
    assert decide(p, segment="chat", acceptance_class="+sampled", alpha_by_segment=(("chat", 0.2, 300),)) == gated
    assert decide(p, segment="chat", acceptance_class="+sampled", alpha_by_segment=(("chat", 0.4, 300),))[0] is SPEC


def test_engine_view_reads_each_classes_live_alpha():
    stats = {"chat": {"alpha": 0.4, "draft_tokens": 500, "live_alpha": 0.41, "live_draft_tokens": 300,
                      "live_alpha_by_class": {"base": {"live_alpha": 0.55, "live_draft_tokens": 200},
                                              "sampled": {"live_alpha": 0.12, "live_draft_tokens": 100}}},
             "code": {"alpha": 0.6, "draft_tokens": 50}}
    v = EngineView.from_spec_by_segment(stats)
    assert v.alpha("chat", "+sampled", 10) == (0.12, 100) and v.alpha("chat", "", 10) == (0.55, 200)
    assert v.alpha("chat", "+sampled", 101) == (0.41, 300)  # too few of its own: the segment's
    assert v.alpha("chat") == (0.41, 300) and v.alpha("code", "+sampled", 10) == (0.6, 50)


def test_a_segment_exactly_at_break_even_is_kept_and_just_below_is_gated():
    """Live α and break-even α are both per position, compared exactly (no rounding on the way
    from the engine's stats): at break-even the segment is not below it and goes on to the
    in-flight hysteresis (rule 7); one ulp below it is gated, except every probe_every-th
    request, which is a probe and itself follows the hysteresis."""
    from cluster.speculative.adaptive_k import StepCostModel, break_even_alpha

    be = break_even_alpha(StepCostModel(target_a_prior=0.02, slope_prior_ratio=0.05, draft_cost_prior=0.004), 4)
    assert 0.0 < be < 1.0
    below = math.nextafter(be, 0.0)

    def route(policy, alpha, in_flight):
        view = EngineView.from_spec_by_segment({"chat": {"live_alpha": alpha, "live_draft_tokens": 100}},
                                               break_even_alpha=be, spec_in_flight=in_flight)
        d = policy.decide(RequestFeatures(segment="chat"), view)
        return d.path, d.reason

    p = RouterPolicy(RouterConfig(enter_threshold=2, exit_threshold=4, min_alpha_samples=10, probe_every=3))
    # at break-even: kept, and the hysteresis decides (enter / stay / exit / come back)
    assert [route(p, be, n) for n in (0, 3, 4, 3, 1)] == [
        (SPEC, RouteReason.BELOW_ENTER_THRESHOLD), (SPEC, RouteReason.HYSTERESIS_SPECULATIVE),
        (PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD), (PLAIN, RouteReason.HYSTERESIS_PLAIN),
        (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)]
    # just below: gated; the third is a due probe, speculative while the hysteresis allows it
    gated, probe = (PLAIN, RouteReason.BELOW_BREAK_EVEN), (SPEC, RouteReason.PROBE_BELOW_BREAK_EVEN)
    assert [route(p, below, 0) for _ in range(6)] == [gated, gated, probe, gated, gated, probe]
    assert [route(p, below, 4) for _ in range(3)] == [gated, gated, (PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD)]
    assert route(p, be, 3) == (PLAIN, RouteReason.HYSTERESIS_PLAIN)  # the probe closed the band
    # the same at a configured min_alpha, and for a segment with settings of its own
    fixed = RouterPolicy(RouterConfig(min_alpha=be, min_alpha_samples=10, probe_every=0,
                                      segments={"chat": {"min_alpha": "auto"}}))
    assert route(fixed, be, 0)[0] is SPEC and route(fixed, below, 0) == gated


@pytest.mark.parametrize("kw", [dict(enter_threshold=0), dict(enter_threshold=5, exit_threshold=4),
                                dict(min_alpha=1.5), dict(min_alpha="half"),
                                dict(min_alpha_samples=-1)])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        RouterConfig(**kw)


def _overflow(p, spec, plain, spec_cap=8, plain_cap=16):
    d = p.decide(RequestFeatures(), EngineView(spec_in_flight=spec, plain_in_flight=plain,
                                               spec_capacity=spec_cap, plain_capacity=plain_cap))
    return d.path, d.reason


def test_overflow_balance_fills_the_spec_engine_only_when_batch_is_fuller():
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=6))
    assert _overflow(p, 6, 0) == (PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD)
    assert not p.spec_open
    # 6/8 spec vs plain/16: plain must pass 12 before the SpecEngine is the less full side
    assert _overflow(p, 6, 12) == (PLAIN, RouteReason.HYSTERESIS_PLAIN)
    assert _overflow(p, 6, 13) == (SPEC, RouteReason.OVERFLOW_BALANCED)
    assert not p.spec_open  # balancing never flips the hysteresis bit
    assert _overflow(p, 10, 21) == (SPEC, RouteReason.OVERFLOW_BALANCED)   # 10/8 < 21/16
    assert _overflow(p, 11, 21) == (PLAIN, RouteReason.HYSTERESIS_PLAIN)   # 11/8 > 21/16
    assert _overflow(p, 11, 22) == (PLAIN, RouteReason.HYSTERESIS_PLAIN)   # equal: plain
    # a burst of 32 arriving one by one ends split in proportion to capacity
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=6))
    spec = plain = 0
    for _ in range(32):
        path, _reason = _overflow(p, spec, plain)
        spec, plain = (spec + 1, plain) if path is SPEC else (spec, plain + 1)
    assert (spec, plain) == (11, 21)


def test_overflow_balance_off_unknown_capacity_or_gated_segment():
    off = RouterPolicy(RouterConfig(enter_threshold=1, exit_threshold=1, balance_overflow=False))
    assert _overflow(off, 1, 100) == (PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD)
    p = RouterPolicy(RouterConfig(enter_threshold=1, exit_threshold=1))
    assert _overflow(p, 1, 100, spec_cap=None) == (PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD)
    # a segment below break-even is gated before hysteresis: never balanced onto the SpecEngine
    p = RouterPolicy(RouterConfig(min_alpha=0.5, min_alpha_samples=1, probe_every=0))
    d = p.decide(RequestFeatures(segment="chat"),
                 EngineView(spec_in_flight=0, plain_in_flight=100, spec_capacity=8, plain_capacity=16,
                            alpha_by_segment=(("chat", 0.1, 50),)))
    assert (d.path, d.reason) == (PLAIN, RouteReason.BELOW_BREAK_EVEN)


def _measure(p, segment, spec_per_token, plain_per_token, counts=range(1, 17)):
    """Completed requests on both paths whose service time per token grows in proportion to the
    requests running beside them."""
    for n in counts:
        p.observe(SPEC, segment, n, service_s=spec_per_token * n * 32, tokens=32)
        p.observe(PLAIN, segment, n, service_s=plain_per_token * n * 32, tokens=32)


def test_overflow_balance_follows_measured_latency_once_both_paths_have_samples():
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=6, overflow_min_samples=8))
    # summarize: the SpecEngine serves a request in a third of the BatchEngine's time per slot
    _measure(p, "summarize", spec_per_token=0.01, plain_per_token=0.03)
    d = p.decide(RequestFeatures(segment="summarize"), EngineView(spec_in_flight=6, plain_in_flight=2,
                                                                  spec_capacity=8, plain_capacity=16))
    assert (d.path, d.reason) == (SPEC, RouteReason.OVERFLOW_BALANCED)  # 7 x 0.01 < 3 x 0.03
    assert not p.spec_open  # measured balancing does not flip the hysteresis bit either
    # a burst of 32 ends split by measured speed (spec 3x the plain count), not capacity (11 / 21)
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=6))
    _measure(p, "summarize", spec_per_token=0.01, plain_per_token=0.03)
    spec = plain = 0
    for _ in range(32):
        d = p.decide(RequestFeatures(segment="summarize"),
                     EngineView(spec_in_flight=spec, plain_in_flight=plain, spec_capacity=8, plain_capacity=16))
        spec, plain = (spec + 1, plain) if d.path is SPEC else (spec, plain + 1)
    assert (spec, plain) == (24, 8)
    # the other way round (plain measured faster), the overflow stays plain where capacity would fill spec
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=6))
    _measure(p, "chat", spec_per_token=0.03, plain_per_token=0.01)
    assert _overflow(p, 6, 15) == (SPEC, RouteReason.OVERFLOW_BALANCED)  # unmeasured segment: 6/8 < 15/16
    d = p.decide(RequestFeatures(segment="chat"),
                 EngineView(spec_in_flight=6, plain_in_flight=15, spec_capacity=8, plain_capacity=16))
    assert (d.path, d.reason) == (PLAIN, RouteReason.HYSTERESIS_PLAIN)  # 7 x 0.03 > 16 x 0.01


def test_overflow_balance_uses_capacity_until_each_path_has_enough_samples():
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=6, overflow_min_samples=8))
    _measure(p, "summarize", spec_per_token=0.01, plain_per_token=0.03, counts=range(1, 8))  # 7 each
    view = EngineView(spec_in_flight=6, plain_in_flight=2, spec_capacity=8, plain_capacity=16)
    assert p.decide(RequestFeatures(segment="summarize"), view).reason is RouteReason.ABOVE_EXIT_THRESHOLD
    p.observe(SPEC, "summarize", 8, service_s=0.08 * 32, tokens=32)  # spec has 8, plain still 7
    assert p.decide(RequestFeatures(segment="summarize"), view).reason is RouteReason.HYSTERESIS_PLAIN
    p.observe(PLAIN, "summarize", 8, service_s=0.24 * 32, tokens=32)
    assert p.decide(RequestFeatures(segment="summarize"), view).reason is RouteReason.OVERFLOW_BALANCED
    with pytest.raises(ValueError):
        RouterConfig(overflow_min_samples=0)


def _spec_view(spec=2, plain=0):
    return EngineView(spec_in_flight=spec, plain_in_flight=plain, spec_capacity=8, plain_capacity=16)


def test_measured_plain_faster_moves_a_request_hysteresis_would_speculate():
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=6, overflow_min_samples=8, probe_every=4))
    chat = RequestFeatures(segment="chat")
    # chat: the SpecEngine per token grows 0.02/running, the BatchEngine 0.01/running
    _measure(p, "chat", spec_per_token=0.02, plain_per_token=0.01)
    d = p.decide(chat, _spec_view(spec=2, plain=0))  # 3 x 0.02 vs 1 x 0.01
    assert (d.path, d.reason) == (PLAIN, RouteReason.MEASURED_PLAIN_FASTER)
    assert p.spec_open  # the hysteresis bit is not touched
    # every probe_every-th request the rule would move still speculates (keeps the spec fit current)
    reasons = [p.decide(chat, _spec_view(spec=2, plain=0)).reason for _ in range(8)]
    assert reasons.count(RouteReason.BELOW_ENTER_THRESHOLD) == 2, reasons
    assert reasons.count(RouteReason.MEASURED_PLAIN_FASTER) == 6, reasons
    # where spec is predicted faster (or within the margin), the hysteresis's choice stands
    d = p.decide(chat, _spec_view(spec=0, plain=1))  # 1 x 0.02 vs 2 x 0.01: a tie, inside the margin
    assert (d.path, d.reason) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)
    d = p.decide(chat, _spec_view(spec=0, plain=3))  # 0.02 vs 0.04
    assert (d.path, d.reason) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)
    # an unmeasured segment, or one measured on a single path, keeps the hysteresis's choice
    assert p.decide(RequestFeatures(segment="code"), _spec_view()).path is SPEC
    for n in range(1, 17):
        p.observe(PLAIN, "code", n, service_s=0.001 * n * 32, tokens=32)
    assert p.decide(RequestFeatures(segment="code"), _spec_view()).path is SPEC


def test_measured_plain_faster_margin_off_switch_and_alpha_probes():
    chat = RequestFeatures(segment="chat")
    # plain 4% faster: inside the default 5% margin -> speculative; a 3% margin moves it
    for margin, path in ((0.05, SPEC), (0.03, PLAIN)):
        p = RouterPolicy(RouterConfig(plain_faster_margin=margin, probe_every=0))
        _measure(p, "chat", spec_per_token=0.01, plain_per_token=0.0096)
        assert p.decide(chat, _spec_view(spec=0, plain=0)).path is path, margin
    off = RouterPolicy(RouterConfig(plain_when_faster=False))
    _measure(off, "chat", spec_per_token=0.02, plain_per_token=0.01)
    assert off.decide(chat, _spec_view()).reason is RouteReason.BELOW_ENTER_THRESHOLD
    # an α probe of a gated segment is never moved plain by the measured rule
    p = RouterPolicy(RouterConfig(min_alpha=0.5, min_alpha_samples=1, probe_every=1))
    _measure(p, "chat", spec_per_token=0.02, plain_per_token=0.01)
    view = EngineView(spec_in_flight=0, spec_capacity=8, plain_capacity=16, alpha_by_segment=(("chat", 0.1, 50),))
    assert p.decide(chat, view).reason is RouteReason.PROBE_BELOW_BREAK_EVEN
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError):
            RouterConfig(plain_faster_margin=bad)


def test_paths_sharing_hardware_count_each_others_load():
    """Both engines on the same cores, each request's time one pool of work: 0.01 s per token per
    request running on either path. With the SpecEngine at 3 and the BatchEngine idle, plain is no
    faster (4 requests on the cores either way): the shared view keeps the request speculative."""
    chat = RequestFeatures(segment="chat")
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=6, overflow_min_samples=8, probe_every=0))
    for b in range(1, 9):
        for o in (0, 2, 5):
            p.observe(SPEC, "chat", b, service_s=0.01 * (b + o) * 32, tokens=32, beside=o)
            p.observe(PLAIN, "chat", b, service_s=0.01 * (b + o) * 32, tokens=32, beside=o)
    shared = EngineView(spec_in_flight=3, plain_in_flight=0, spec_capacity=8, plain_capacity=16, paths_shared=True)
    assert shared.joining(PLAIN) == (PLAIN, 1, 16, 3) and shared.joining(SPEC) == (SPEC, 4, 8, 0)
    assert p.decide(chat, shared).path is SPEC
    # told the paths do not share (each has its own hardware), plain at 1 running is faster
    apart = EngineView(spec_in_flight=3, plain_in_flight=0, spec_capacity=8, plain_capacity=16)
    assert apart.joining(PLAIN) == (PLAIN, 1, 16, 0)
    assert p.decide(chat, apart).reason is RouteReason.MEASURED_PLAIN_FASTER
    with pytest.raises(ValueError, match="paths_share_hardware"):
        RouterConfig(paths_share_hardware="sometimes")
