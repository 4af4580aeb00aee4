"""Phase 3 on synthetic measurements with known answers: crossover per segment, drafter, K,
router thresholds and min_alpha; and the written config loads with the app's own AppConfig."""
from __future__ import annotations

import pytest

from cluster.speculative.acceptance import expected_committed
from cluster.mapper.decide import break_even_alpha, decide
from cluster.mapper.write import mapped_args, serve_config_text
from deployments.app_config import AppConfig

LEVELS = [1, 2, 4, 8, 16]


def _row(speedup, alpha, best_num_draft_tokens=3, k_mean=4.0, mal=3.0, c=0.05, v=1.2):
    return {"speedup": speedup, "predicted_speedup": speedup, "alpha": alpha, "best_num_draft_tokens": best_num_draft_tokens,
            "k_mean": k_mean, "mean_acceptance_length": mal, "c": c, "v": v}


def _cells(seg, ratios, plain_s=1.0):
    cells = []
    for c, r in zip(LEVELS, ratios):
        for policy, e2e in (("fixed_spec", plain_s * r), ("fixed_plain", plain_s)):
            xs = [e2e * f for f in (0.98, 0.99, 1.0, 1.01, 1.02)]
            cells.append({"segment": seg, "concurrency": c, "policy": policy, "e2e_s": xs, "e2e_p50": e2e,
                          "tpot_p50": e2e / 32})
    return cells


def _state(alpha_a=0.8):
    return {"traffic": {"shares": {"a": 0.7, "b": 0.3}},
            "profile": {"segments": {
                "a": {"drafters": {"ngram": _row(2.0, alpha_a, best_num_draft_tokens=3), "self": _row(1.5, 0.6, best_num_draft_tokens=2)}},
                "b": {"drafters": {"ngram": _row(0.8, 0.2, best_num_draft_tokens=0), "self": _row(1.2, 0.4, best_num_draft_tokens=1)}}}},
            "sweep": {"cells": _cells("a", [0.5, 0.7, 0.9, 1.1, 1.3]) + _cells("b", [1.05, 1.1, 1.2, 1.3, 1.4])}}


def test_break_even_alpha():
    assert break_even_alpha(4, 0.0, 1.0) == 0.0  # free drafts pay at any α
    assert break_even_alpha(4, 1.0, 1.0) == 1.0  # 5 plain steps for at most 5 tokens
    be = break_even_alpha(4, 0.05, 1.2)
    assert expected_committed(be, 4) == pytest.approx(4 * 0.05 + 1.2, abs=1e-3)  # α rounded to 4 places


def test_decide_known_answers():
    app = AppConfig(model="fake", drafter="ngram")
    d = decide(_state(), app)
    a, b = d["segments"]["a"], d["segments"]["b"]
    assert a["crossover"]["kind"] == "within" and a["crossover"]["value"] == pytest.approx(2 ** 2.5, rel=1e-3)
    lo, hi = a["crossover"]["ci90"]
    assert lo <= a["crossover"]["value"] <= hi
    assert a["speculate"] and a["best_drafter"] == "ngram" and a["best_num_draft_tokens"] == 3
    assert b["crossover"]["kind"] == "below" and not b["speculate"] and b["crossover_for_router"] == 1.0
    assert b["best_drafter"] == "self"
    assert d["cost_model"]["points"] == 2 * 2 * len(LEVELS)  # both segments, both paths, every level
    k = d["knobs"]
    assert k["drafter"] == "ngram"  # 0.7 x 2.0 + 0.3 x 0.8 = 1.64 > self's 1.41
    assert k["num_draft_tokens"] == 3  # the only gaining segment's best K
    # traffic-weighted median crossover: segment a (70%) at 5.66 -> exit 6, enter 4
    assert k["router"]["exit_threshold"] == 6 and k["router"]["enter_threshold"] == 4
    be = break_even_alpha(4.0, 0.05, 1.2)
    assert k["break_even_alpha"] == be and k["router"]["min_alpha"] == round(be, 2)
    # a's own crossover gives the global thresholds: nothing of its own; b never gained: gated
    assert k["router"]["segments"] == {"b": {"enter_threshold": 1, "exit_threshold": 1, "min_alpha": 1.0}}
    rc = AppConfig(**mapped_args({"model": "fake"}, k)).router_config()
    assert rc.knobs("b") == (1, 1, 1.0) and rc.knobs("a") == (4, 6, round(be, 2))


def test_a_segment_with_its_own_crossover_gets_its_own_thresholds():
    state = _state()
    state["traffic"]["shares"] = {"a": 0.7, "b": 0.3}
    state["sweep"]["cells"] = _cells("a", [0.5, 0.7, 0.9, 1.1, 1.3]) + _cells("b", [0.3, 0.4, 0.5, 0.7, 1.1])
    k = decide(state, AppConfig(model="fake"))["knobs"]
    cross_b = 2 ** (3 + 0.3 / 0.4)  # between 8 (0.7) and 16 (1.1)
    assert k["router"]["exit_threshold"] == 6  # a carries the traffic-weighted median
    b = k["router"]["segments"]["b"]
    assert (b["enter_threshold"], b["exit_threshold"]) == (round(round(cross_b) * 2 / 3), round(cross_b))
    assert "enter_threshold" not in k["router"]["segments"]["a"]  # a's K of its own only (below)


def test_min_alpha_never_gates_a_gaining_segment():
    d = decide(_state(alpha_a=0.2), AppConfig(model="fake"))
    be = break_even_alpha(4.0, 0.05, 1.2)
    assert be > 0.2
    assert d["knobs"]["router"]["min_alpha"] == pytest.approx(0.18)


def test_no_segment_gains_turns_speculation_off_and_config_still_loads():
    state = _state()
    state["sweep"]["cells"] = _cells("a", [1.2] * 5) + _cells("b", [1.3] * 5)
    app = AppConfig(model="fake", drafter="ngram", placement="separate")
    d = decide(state, app)
    assert d["knobs"]["drafter"] == "none"
    args = mapped_args(app.model_dump(mode="json"), d["knobs"])
    assert args["drafter"] == "none" and args["placement"] == "shared"
    assert not AppConfig(**args).speculative


def test_mapped_config_keeps_everything_else_and_refuses_what_the_app_refuses():
    import yaml

    base = {"applications": [{"name": "specserve", "import_path": "deployments.app:build",
                               "args": {"model": "fake", "drafter": "ngram", "torch_threads": 1,
                                        "router": {"probe_every": 7}}}],
            "grpc_options": {"port": 9000}}
    d = decide(_state(), AppConfig(**base["applications"][0]["args"]))
    args = mapped_args(base["applications"][0]["args"], d["knobs"])
    assert args["router"]["probe_every"] == 7 and args["router"]["exit_threshold"] == 6
    text = serve_config_text(base, args, d, "traffic.jsonl")
    cfg = yaml.safe_load(text)
    assert cfg["grpc_options"] == {"port": 9000}
    assert AppConfig(**cfg["applications"][0]["args"]).router.exit_threshold == 6
    assert "#   a: share 0.7, speculate=True" in text
    bad = dict(d["knobs"], router={"enter_threshold": 9, "exit_threshold": 2, "min_alpha": 0.1})
    with pytest.raises(ValueError, match="exit_threshold"):
        mapped_args(base["applications"][0]["args"], bad)


def test_drafter_changes_only_for_a_real_gain():
    state = _state()
    assert decide(state, AppConfig(model="fake", drafter="self"))["knobs"]["drafter"] == "ngram"  # 16% faster
    # self within 5% of ngram: the configured drafter stays
    state["profile"]["segments"]["a"]["drafters"]["self"]["speedup"] = 1.95
    state["profile"]["segments"]["b"]["drafters"]["self"]["speedup"] = 0.8
    assert decide(state, AppConfig(model="fake", drafter="self"))["knobs"]["drafter"] == "self"
    assert decide(state, AppConfig(model="fake", drafter="ngram"))["knobs"]["drafter"] == "ngram"


def test_profile_prediction_per_position_and_best_k():
    from cluster.bench.timed_run import Run
    from cluster.mapper.profile import alpha_by_position, predicted_speedups, summarize_pair

    # exactly one of four drafts accepted every step: per position p = [1, 0, 0, 0]
    p = [1.0, 0.0, 0.0, 0.0]
    assert alpha_by_position([0.8, 0.4, 0.1]) == pytest.approx([0.8, 0.5, 0.25])
    assert predicted_speedups(p, 0.0, 1.0, 4) == {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0}
    by_k = predicted_speedups([0.9, 0.7, 0.4, 0.1], 0.1, 1.2, 4)
    assert by_k[2] == pytest.approx((1 + 0.9 + 0.7) / (2 * 0.1 + 1.1), abs=1e-4)

    def run(wall, acc, dr, steps):
        r = Run(wall, 24, [], decode_steps=[] if dr else [0.01] * steps, verify_steps=[0.0099] * steps if dr else [])
        r.accepted_per_position, r.drafted_per_position = acc, dr
        r.draft_tokens, r.accepted_tokens, r.drafts = sum(dr), 1 * steps, steps
        r.rejections, r.steps_by_num_draft_tokens = (steps, [0, 0, 0, 0, steps]) if dr else (0, [])
        return r

    plain = [run(0.24, [], [], 24)]
    spec = [run(0.12, [12, 0, 0, 0], [12, 12, 12, 12], 12)]
    row = summarize_pair(plain, spec, 4)
    assert row["acceptance_rate"] == 0.25 and row["alpha_by_position"] == [1.0, 0.0, 0.0, 0.0]
    assert row["alpha"] == 0.5  # 1 acceptance and 1 rejection a step
    assert row["predicted_speedup"] == pytest.approx(2.0, rel=0.02)
    # one α for every position: E(0.5, 4) / v = 1.9375 / 0.99 (accepted/drafted would say 1.33)
    assert row["predicted_speedup_alpha_only"] == pytest.approx(1.957, rel=0.01)
    assert row["best_num_draft_tokens"] == 1  # v < 1 (timing noise) is clamped to 1: extra drafts gain nothing


def test_a_loss_at_the_lowest_level_within_noise_keeps_a_profile_gain_at_low_load():
    state = _state()
    noisy = _cells("b", [1.05, 1.1, 1.2, 1.3, 1.4])
    for c in noisy:  # b's c=1 cell: spread wide enough that 1.05 is within noise
        if c["concurrency"] == 1:
            c["e2e_s"] = [x * f for x, f in zip(c["e2e_s"], (0.5, 0.8, 1.0, 1.3, 1.9))]
    state["sweep"]["cells"] = _cells("a", [0.5, 0.7, 0.9, 1.1, 1.3]) + noisy
    state["profile"]["segments"]["b"]["drafters"]["self"]["speedup"] = 1.2  # b's best drafter gains
    b = decide(state, AppConfig(model="fake"))["segments"]["b"]
    assert b["crossover"]["kind"] == "below" and b["crossover"]["lowest_level_ratio_ci90"][0] < 1.0
    assert b["speculate"] and b["crossover_for_router"] == 2.0  # alone on the SpecEngine only
    clear = decide(_state(), AppConfig(model="fake"))["segments"]["b"]
    assert clear["crossover"]["lowest_level_ratio_ci90"][0] > 1.0 and not clear["speculate"]


def test_thresholds_extrapolate_at_most_one_doubling_past_the_sweep():
    from cluster.mapper.decide import _router_crossover

    def seg(kind, predicted, value=None):
        return {"speculate": True, "crossover": {"kind": kind, "value": value}, "levels": LEVELS,
                "predicted_crossover": predicted}

    assert _router_crossover(seg("above", 44.0)) == 32.0  # the model's 44: one doubling past 16
    assert _router_crossover(seg("above", 20.0)) == 20.0
    assert _router_crossover(seg("above", 10.0)) == 16.0  # won at 16: at least 16
    assert _router_crossover(seg("above", None)) == 16.0
    assert _router_crossover(seg("within", 44.0, value=5.5)) == 5.5  # measured beats the model
    assert _router_crossover({"speculate": True, "predicted_crossover": 7.0}) == 7.0  # not swept
    assert _router_crossover({"speculate": False}) == 1.0


def test_segments_preferring_different_drafters_and_k_get_their_own():
    """a (ngram, K 3) and b (self 1.2x vs ngram 0.8x at c=1, K 1) both gain: the global drafter
    stays ngram (traffic-weighted), b drafts with self, each keeps its K, the global K is auto —
    and the written config loads with the app's AppConfig and puts them in the SpecEngine."""
    state = _state()
    state["sweep"]["cells"] = _cells("a", [0.5, 0.7, 0.9, 1.1, 1.3]) + _cells("b", [0.3, 0.4, 0.5, 0.7, 1.1])
    d = decide(state, AppConfig(model="fake", drafter="ngram"))
    k = d["knobs"]
    assert k["drafter"] == "ngram" and k["num_draft_tokens"] == "auto"
    segs = k["router"]["segments"]
    assert segs["a"] == {"num_draft_tokens": 3}
    assert segs["b"]["drafter"] == "self" and segs["b"]["num_draft_tokens"] == 1 and "exit_threshold" in segs["b"]
    assert "b: self" in k["why"]["segment_drafters"] and "each its own" in k["why"]["num_draft_tokens"]
    spec = AppConfig(**mapped_args({"model": "fake"}, k)).engine_config(True).spec
    assert [(spec.drafter_for(s), spec.k_policy(s)) for s in ("a", "b", "unseen")] == [
        ("ngram", 3), ("self", 1), ("ngram", "auto")]
    from cluster.mapper.report import render

    report = render({"traffic": {"rows": 2, "shares": state["traffic"]["shares"], "files": ["t"], "bad_rows": [],
                                 "sampled_rows": 2}}, d, {})
    assert "b drafts with self at K 1" in report and "a drafts with ngram at K 3" in report
    # placement separate: one DraftServer serves the global drafter, so b keeps ngram (and its K)
    sep = decide(state, AppConfig(model="fake", drafter="ngram", placement="separate"))["knobs"]
    assert all("drafter" not in own for own in sep["router"]["segments"].values())
    assert sep["router"]["segments"]["b"]["num_draft_tokens"] == 0
    AppConfig(**mapped_args({"model": "fake", "placement": "separate"}, sep))
    # segments that agree on K: one global K, nothing per segment
    state["profile"]["segments"]["b"]["drafters"]["self"]["best_num_draft_tokens"] = 3
    same = decide(state, AppConfig(model="fake", drafter="ngram"))["knobs"]
    assert same["num_draft_tokens"] == 3 and "num_draft_tokens" not in same["router"]["segments"].get("b", {})
