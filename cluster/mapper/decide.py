"""Phase 3 of ``specserve map``: from the profile and the sweep to choices.

Owns: per segment the crossover concurrency (measured, with its bootstrap interval, and predicted
by the fitted cost model), the best drafter and K, whether it speculates at all; and the global
knobs the service reads — ``drafter``, ``num_draft_tokens``, ``router.enter_threshold`` /
``exit_threshold`` (the traffic-weighted median crossover: leave the SpecEngine where the typical
request stops gaining, come back a third lower), ``router.min_alpha`` (the break-even α of the
chosen drafter's measured c and v, lowered below any segment that measured a gain, so the rule
never sends a winning segment plain) and ``router.segments`` (a segment's own thresholds where its
crossover differs; a segment that never gained gated; a speculating segment's own ``drafter`` where
another drafter is clearly faster on it than the global one — placement ``shared`` only — and its
own ``num_draft_tokens`` when the speculating segments prefer different K, the global K then
"auto" for segments the map has not seen). Ignores: writing files (``write``) and plotting.
"""
from __future__ import annotations

import statistics

from cluster.mapper.cost_model import GRID, PathShape, fit, r_squared
from cluster.mapper.crossover import bootstrap_crossover
from cluster.speculative.acceptance import expected_committed
from deployments.app_config import Placement

ALPHA_FLOOR_MARGIN = 0.02  # min_alpha this far below the α of the weakest segment that gains
EXTRAPOLATE_LEVELS = 2.0  # router thresholds trust the cost model up to 2x the highest level run
DRAFTER_SWITCH_GAIN = 0.05  # another drafter replaces the configured one only when this much faster


def break_even_alpha(k: float, c: float, v: float) -> float:
    """The α at which K drafts per step just pay: E(α, K) = K·c + v (bisection)."""
    cost = k * c + v
    if k <= 0 or cost <= 1.0:
        return 0.0
    if cost >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_committed(mid, k) < cost:
            lo = mid
        else:
            hi = mid
    return round(hi, 4)


def _weighted_median(values: dict[str, float], weights: dict[str, float]) -> float | None:
    items = sorted((v, weights.get(k, 0.0)) for k, v in values.items() if v is not None)
    total = sum(w for _, w in items)
    if not items or total <= 0:
        return None
    acc = 0.0
    for v, w in items:
        acc += w
        if acc >= total / 2:
            return v
    return items[-1][0]


def _cells_by(cells: list[dict]) -> dict[str, dict[int, dict[str, dict]]]:
    out: dict[str, dict[int, dict[str, dict]]] = {}
    for c in cells:
        out.setdefault(c["segment"], {}).setdefault(c["concurrency"], {})[c["policy"]] = c
    return out


def _caps(app) -> tuple[int, int]:
    return (app.spec_engine.max_num_seqs * app.spec_engine.num_replicas,
            app.batch_engine.max_num_seqs * app.batch_engine.num_replicas)


def decide(state: dict, app) -> dict:
    shares: dict[str, float] = state["traffic"]["shares"]
    prof = (state.get("profile") or {}).get("segments", {})
    cells = (state.get("sweep") or {}).get("cells", [])
    by = _cells_by(cells)
    cap_spec, cap_plain = _caps(app)
    plain_shape = PathShape(cap_plain, 1.0, 1.0, False)
    segments: dict[str, dict] = {}
    shapes: dict[str, PathShape] = {}
    points = []
    for seg in shares:
        drafters = (prof.get(seg) or {}).get("drafters", {})
        d = {"share": round(shares[seg], 4)}
        if drafters:
            best = max(drafters, key=lambda n: (drafters[n]["speedup"] or 0.0, drafters[n]["predicted_speedup"] or 0.0))
            row = drafters[best]
            d.update(best_drafter=best, best_num_draft_tokens=row["best_num_draft_tokens"], alpha=row["alpha"],
                     speedup_c1=row["speedup"], predicted_speedup_c1=row["predicted_speedup"])
            served = drafters.get(app.drafter) or row  # the drafter the swept service ran
            shapes[seg] = PathShape(cap_spec, (served["k_mean"] or 0.0) + 1.0,
                                    max(served["mean_acceptance_length"] or 1.0, 1e-6), True)
        levels = sorted(lv for lv, pol in by.get(seg, {}).items() if "fixed_spec" in pol and "fixed_plain" in pol
                        and pol["fixed_spec"]["e2e_s"] and pol["fixed_plain"]["e2e_s"])
        if levels:
            spec = [by[seg][lv]["fixed_spec"] for lv in levels]
            plain = [by[seg][lv]["fixed_plain"] for lv in levels]
            d["levels"] = levels
            d["ratio_spec_over_plain"] = [round(s["e2e_p50"] / p["e2e_p50"], 4) for s, p in zip(spec, plain)]
            d["speedup_by_level"] = [round(p["e2e_p50"] / s["e2e_p50"], 4) for s, p in zip(spec, plain)]
            d["crossover"] = bootstrap_crossover(levels, [s["e2e_s"] for s in spec], [p["e2e_s"] for p in plain])
            if seg in shapes:
                for lv, s, p in zip(levels, spec, plain):
                    points += [(shapes[seg], lv, s["tpot_p50"]), (plain_shape, lv, p["tpot_p50"])]
        segments[seg] = d
    model = fit(points)
    out: dict = {"segments": segments, "capacity": {"speculative": cap_spec, "plain": cap_plain}}
    if model is not None:
        out["cost_model"] = {"a_s": round(model.a, 6), "beta_s_per_token": round(model.beta, 7),
                             "delta_s_per_seq": round(model.delta, 7), "r_squared": r_squared(model, points),
                             "points": len(points), "grid": list(GRID)}
        for seg, d in segments.items():
            if seg in shapes:
                sh = shapes[seg]
                d["predicted_crossover"] = model.crossover(sh, plain_shape)
                d["predicted_ratio"] = {str(c): round(model.ratio(sh, plain_shape, c), 4) for c in GRID}
    for d in segments.values():
        d["speculate"] = _speculates(d)
        d["crossover_for_router"] = _router_crossover(d)
    out["knobs"] = _knobs(segments, prof, app)
    return out


def _speculates(d: dict) -> bool:
    """Whether the segment gains at all. The sweep (through the service) decides when it ran:
    speculation won at some level, or plain was clearly as fast already at the lowest (its ratio's
    interval above 1). A loss there within noise, or no sweep, leaves it to the profile's measured
    speedup at concurrency 1 (then at the lowest load only, ``_router_crossover``)."""
    profile_gain = bool(d.get("speedup_c1") and d["speedup_c1"] > 1.0)
    cross = d.get("crossover")
    if cross is None:
        return profile_gain
    if cross["kind"] != "below":
        return True
    ci = cross.get("lowest_level_ratio_ci90")
    return profile_gain and not (ci and ci[0] > 1.0)


def _router_crossover(d: dict) -> float | None:
    """The concurrency below which this segment should speculate: measured if it crossed; if it
    still won at the highest level run, that level or the cost model's crossover if beyond;
    unswept, the cost model's."""
    cross = d.get("crossover")
    if not d["speculate"]:
        return 1.0
    if cross and cross["kind"] == "within":
        return cross["value"]
    if cross and cross["kind"] == "below":  # lost at the lowest level, but within noise
        return float(d["levels"][0]) + 1.0
    if cross:  # still winning at the highest level run: at least there, further if the model
        top = float(d["levels"][-1])  # says so, but not past one doubling (unmeasured ground)
        return min(max(top, d.get("predicted_crossover") or 0.0), EXTRAPOLATE_LEVELS * top)
    return d.get("predicted_crossover")


def _thresholds(crossover: float) -> tuple[int, int]:
    """(enter, exit) for a crossover: leave the SpecEngine where speculation stops gaining, come
    back a third lower (the hysteresis band keeps a load near the crossover from flapping)."""
    exit_ = max(1, int(round(crossover)))
    return max(1, min(exit_, int(round(exit_ * 2 / 3)))), exit_


def _segment_router(segments: dict, router: dict) -> dict[str, dict]:
    """Per-segment router settings where a segment's own crossover disagrees with the global
    thresholds; a segment that never gained is gated (min_alpha 1.0 once its α is measured, and
    it leaves the SpecEngine as soon as anything runs there)."""
    out = {}
    for seg, d in segments.items():
        if not d["speculate"]:
            out[seg] = {"enter_threshold": 1, "exit_threshold": 1, "min_alpha": 1.0}
        elif d["crossover_for_router"] is not None:
            enter, exit_ = _thresholds(d["crossover_for_router"])
            if (enter, exit_) != (router["enter_threshold"], router["exit_threshold"]):
                out[seg] = {"enter_threshold": enter, "exit_threshold": exit_}
    return out


def _segment_engine(gaining: dict, prof: dict, knobs: dict, app) -> dict[str, dict]:
    """The SpecEngine's per-segment settings, and the global K: a speculating segment whose best
    drafter is ``DRAFTER_SWITCH_GAIN`` faster on it than the global drafter gets its own
    (placement ``shared``: a DraftServer serves the global drafter only); each segment's K is the
    best K of the drafter in force for it — one K for all when they agree (the global K), else
    each its own ``num_draft_tokens`` and the global K "auto" (adaptive for unseen segments)."""
    out: dict[str, dict] = {}
    num_draft_tokens: dict[str, int] = {}
    switched = []
    for seg, d in gaining.items():
        drafters = (prof.get(seg) or {}).get("drafters", {})
        best, glob = d.get("best_drafter"), drafters.get(knobs["drafter"])
        drafter = knobs["drafter"]
        if (best and best != drafter and app.placement is Placement.SHARED and (glob is None or
                (drafters[best]["speedup"] or 0.0) > (glob["speedup"] or 0.0) * (1 + DRAFTER_SWITCH_GAIN))):
            drafter = best
            out[seg] = {"drafter": best}
            switched.append(f"{seg}: {best}")
        row = drafters.get(drafter)
        k = row.get("best_num_draft_tokens") if row is not None else d.get("best_num_draft_tokens")
        if k is not None:
            num_draft_tokens[seg] = k
    if switched:
        knobs["why"]["segment_drafters"] = (f"faster than the global {knobs['drafter']!r} by over "
                                            f"{DRAFTER_SWITCH_GAIN:.0%} on these segments at concurrency 1: "
                                            + ", ".join(switched))
    if len(set(num_draft_tokens.values())) == 1:
        knobs["num_draft_tokens"] = next(iter(num_draft_tokens.values()))
        knobs["why"]["num_draft_tokens"] = "every speculating segment predicts its best speedup at this K"
    elif num_draft_tokens:
        knobs["num_draft_tokens"] = "auto"
        for seg, k in num_draft_tokens.items():
            out.setdefault(seg, {})["num_draft_tokens"] = k
        knobs["why"]["num_draft_tokens"] = (f"segments prefer different K ({dict(sorted(num_draft_tokens.items()))}): each its "
                                           "own (router.segments.<name>.num_draft_tokens); adaptive K for the rest")
    return out


def _knobs(segments: dict, prof: dict, app) -> dict:
    shares = {s: d["share"] for s, d in segments.items()}
    gaining = {s: d for s, d in segments.items() if d["speculate"]}
    knobs: dict = {"drafter": app.drafter, "num_draft_tokens": app.num_draft_tokens,
                   "router": {"enter_threshold": app.router.enter_threshold,
                              "exit_threshold": app.router.exit_threshold,
                              "min_alpha": app.router.min_alpha},
                   "why": {}}
    # drafter: the best traffic-weighted measured speedup at concurrency 1
    scores: dict[str, float] = {}
    for seg, p in prof.items():
        for name, row in p.get("drafters", {}).items():
            scores[name] = scores.get(name, 0.0) + shares.get(seg, 0.0) * (row["speedup"] or 0.0)
    if scores:
        best = max(scores, key=scores.get)
        if app.drafter in scores and scores[best] <= scores[app.drafter] * (1 + DRAFTER_SWITCH_GAIN):
            best = app.drafter  # within noise of the configured one: no change without a gain
        knobs["drafter"] = best
        knobs["why"]["drafter"] = (f"traffic-weighted speedup at concurrency 1: {({k: round(v, 3) for k, v in scores.items()})}"
                                   f"; the configured {app.drafter!r} is kept unless another is "
                                   f"{DRAFTER_SWITCH_GAIN:.0%} faster")
    if not gaining and any(d.get("crossover") for d in segments.values()):
        knobs["drafter"] = "none"
        knobs["why"]["drafter"] = "no segment was faster speculated at any concurrency measured"
        return knobs
    engine = _segment_engine(gaining, prof, knobs, app)
    # global thresholds from the segments that speculate (the others are gated by their own)
    x = _weighted_median({s: d["crossover_for_router"] for s, d in gaining.items()}, shares)
    if x is not None:
        knobs["router"]["enter_threshold"], knobs["router"]["exit_threshold"] = _thresholds(x)
        knobs["why"]["thresholds"] = f"traffic-weighted median crossover {x:g} concurrent requests"
    own = _segment_router(segments, knobs["router"])
    for seg, settings in engine.items():
        own.setdefault(seg, {}).update(settings)
    knobs["router"]["segments"] = own
    if own:
        knobs["why"]["segments"] = ("segments whose own crossover differs from the global thresholds get their "
                                    "own (router.segments); a segment that never gained gets min_alpha 1.0")
    rows = [prof[s]["drafters"][knobs["drafter"]] for s in prof if knobs["drafter"] in prof[s].get("drafters", {})]
    if rows:
        k = statistics.median([r["k_mean"] or 0.0 for r in rows])
        c = statistics.median([r["c"] or 0.0 for r in rows])
        v = statistics.median([r["v"] or 1.0 for r in rows])
        be = break_even_alpha(k, c, v)
        floor = min((d["alpha"] for d in gaining.values() if d.get("alpha") is not None), default=None)
        min_alpha = be if floor is None else min(be, max(0.0, floor - ALPHA_FLOOR_MARGIN))
        knobs["router"]["min_alpha"] = round(min_alpha, 2)
        knobs["break_even_alpha"] = be
        knobs["why"]["min_alpha"] = (f"break-even α {be} of {knobs['drafter']} (K={k:g}, c={c:g}, v={v:g})"
                                     + (f", kept below the weakest gaining segment's α {floor}"
                                        if floor is not None and floor - ALPHA_FLOOR_MARGIN < be else ""))
    return knobs
