"""Per-segment router settings (``RouterConfig.segments``, written by ``specserve map``): a
segment with its own thresholds and min_alpha follows them, with its own hysteresis bit when it has
thresholds of its own; every other segment keeps the global settings. ModelInfo shows what is in
force per segment, the SpecEngine's drafter and K policy included."""
import pytest

from cluster.routing.policy import (EngineView, Path, RequestFeatures, RouteReason, RouterConfig,
                                    RouterPolicy)
from deployments.app_config import AppConfig

SPEC, PLAIN = Path.SPECULATIVE, Path.PLAIN


def decide(policy, segment, in_flight, alpha_by_segment=()):
    d = policy.decide(RequestFeatures(segment=segment),
                      EngineView(spec_in_flight=in_flight, alpha_by_segment=alpha_by_segment))
    return d.path, d.reason


def test_own_thresholds_and_hysteresis_bit_per_segment():
    p = RouterPolicy(RouterConfig(enter_threshold=4, exit_threshold=8, min_alpha=0.3, plain_when_faster=False,
                                  balance_overflow=False,
                                  segments={"chat": {"enter_threshold": 1, "exit_threshold": 2}}))
    # (segment, SpecEngine in flight) -> expected; code follows 4/8, chat 1/2, and chat leaving
    # the SpecEngine does not take code with it (nor the reverse)
    table = [
        ("chat", 1, SPEC, RouteReason.HYSTERESIS_SPECULATIVE),
        ("chat", 2, PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD),
        ("code", 2, SPEC, RouteReason.BELOW_ENTER_THRESHOLD),
        ("chat", 1, PLAIN, RouteReason.HYSTERESIS_PLAIN),
        ("code", 8, PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD),
        ("other", 5, PLAIN, RouteReason.HYSTERESIS_PLAIN),  # shares the global bit with code
        ("chat", 0, SPEC, RouteReason.BELOW_ENTER_THRESHOLD),
        ("code", 5, PLAIN, RouteReason.HYSTERESIS_PLAIN),
        ("code", 3, SPEC, RouteReason.BELOW_ENTER_THRESHOLD),
    ]
    for seg, n, path, reason in table:
        assert decide(p, seg, n) == (path, reason), (seg, n)
    assert p.spec_open  # the global bit: code's


def test_own_min_alpha_gates_only_its_segment():
    p = RouterPolicy(RouterConfig(min_alpha=0.3, min_alpha_samples=10, probe_every=0,
                                  segments={"json": {"min_alpha": 1.0}}))
    alphas = (("code", 0.9, 100), ("json", 0.9, 100))
    assert decide(p, "json", 0, alphas) == (PLAIN, RouteReason.BELOW_BREAK_EVEN)
    assert decide(p, "code", 0, alphas) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)
    assert p.min_alpha(EngineView(), "json") == 1.0 and p.min_alpha(EngineView(), "code") == 0.3
    assert p.min_alpha(EngineView()) == 0.3


def test_unset_keys_fall_back_and_bad_settings_name_the_segment():
    cfg = RouterConfig(enter_threshold=2, exit_threshold=6, segments={"chat": {"exit_threshold": 3}})
    assert cfg.knobs("chat") == (2, 3, "auto") and cfg.knobs("code") == (2, 6, "auto")
    with pytest.raises(ValueError, match=r"router.segments.chat.exit_threshold \(1\) must be >= enter_threshold \(2\)"):
        RouterConfig(enter_threshold=2, exit_threshold=6, segments={"chat": {"exit_threshold": 1}})
    with pytest.raises(ValueError, match="router.segments.json.min_alpha"):
        RouterConfig(segments={"json": {"min_alpha": 1.5}})
    with pytest.raises(ValueError, match="exit_threshold"):  # the app's own config refuses it too
        AppConfig(router={"segments": {"chat": {"enter_threshold": 5, "exit_threshold": 3}}})
    with pytest.raises(ValueError, match="extra"):
        AppConfig(router={"segments": {"chat": {"k": 3}}})
    assert AppConfig(router={"segments": {"chat": {"exit_threshold": 9}}}).router_config().knobs("chat") == (4, 9, "auto")


def test_a_segment_without_own_thresholds_shares_the_global_hysteresis_bit():
    """Only a segment's own thresholds give it a bit of its own: one that sets min_alpha (or
    only the SpecEngine's drafter / K, which the Router does not see) follows the global bit."""
    p = RouterPolicy(AppConfig(router={"enter_threshold": 2, "exit_threshold": 4, "plain_when_faster": False,
                                       "balance_overflow": False,
                                       "segments": {"code": {"num_draft_tokens": 2}, "json": {"min_alpha": 0.1}}}
                               ).router_config())
    assert decide(p, "other", 4) == (PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD)
    assert decide(p, "code", 3) == (PLAIN, RouteReason.HYSTERESIS_PLAIN)  # the global bit is off
    assert decide(p, "json", 1) == (SPEC, RouteReason.BELOW_ENTER_THRESHOLD)
    assert decide(p, "other", 3) == (SPEC, RouteReason.HYSTERESIS_SPECULATIVE)  # json turned it on


def test_model_info_shows_the_settings_in_force_per_segment():
    from cluster.api import stubs
    from deployments.router import segment_routing_pb

    pb2 = stubs.generation_pb2()
    app = AppConfig(drafter="ngram", num_draft_tokens=3, router={
        "enter_threshold": 4, "exit_threshold": 8,
        "segments": {"json": {"min_alpha": 1.0}, "chat": {"exit_threshold": 5, "num_draft_tokens": "auto"},
                     "code": {"drafter": "suffix"}}})
    p = RouterPolicy(app.router_config())
    info = pb2.ModelInfoResponse(segment_routing=segment_routing_pb(pb2, p, EngineView(break_even_alpha=0.2),
                                                                    app.spec_config()))
    got = [(s.segment, s.enter_threshold, s.exit_threshold, round(s.min_alpha, 4), s.min_alpha_auto,
            s.drafter, s.num_draft_tokens, s.own_drafter, s.own_num_draft_tokens)
           for s in pb2.ModelInfoResponse.FromString(info.SerializeToString()).segment_routing]
    assert got == [("chat", 4, 5, 0.2, True, "ngram", "auto", False, True),
                   ("code", 4, 8, 0.2, True, "suffix", "3", True, False),
                   ("json", 4, 8, 1.0, False, "ngram", "3", False, False)]
    assert segment_routing_pb(pb2, RouterPolicy(RouterConfig()), EngineView()) == []
    no_spec = segment_routing_pb(pb2, RouterPolicy(RouterConfig(segments={"json": {"min_alpha": 1.0}})), EngineView())
    assert [(s.drafter, s.num_draft_tokens) for s in no_spec] == [("none", "0")]
