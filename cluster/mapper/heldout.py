"""`specserve bench mapped`: does the config `specserve map` writes beat the shipped one on traffic
the map never saw?

Owns: splitting each workload segment's rows into a map sample (even rows) and a held-out sample
(odd rows), running ``specserve map`` on the sample, then ``bench serve`` on the held-out rows twice
— once with the mapped config, once with the base (shipped) config, each a fresh local service with
fixed-spec, fixed-plain and routed side by side per level — and judging the issue's goals per
(segment, concurrency) cell: routed p50 with the mapped config ≤ 1.0× the better fixed policy of
the same run (``MAPPED_GOAL``; also with its 90% bootstrap interval, since routed that sends every
request down the better policy's path still differs from it by run-to-run noise), mapped routed
never worse than shipped routed beyond noise (the 90%
bootstrap interval of their ratio reaches ≤ 1.0), and the map's crossover (measured on the
sample, or predicted by its cost model) within one concurrency level of the crossover the
held-out fixed cells show. Table on stdout, JSON file.
Ignores: how each part measures (``cluster.mapper``, ``cluster.bench.serve``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from cluster.bench.serve import percentile, ratio_interval
from cluster.common.prompt_rows import DEFAULT_WORKLOADS
from cluster.common.errors import UserFacingError

MAPPED_GOAL = 1.0  # routed p50 with the mapped config <= the better fixed policy's
QUICK = {"levels": "1,4,16", "requests": 4, "max_tokens": 16, "rows_per_segment": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="output JSON file")
    p.add_argument("--out", type=Path, required=True, help="work directory (samples, the map, bench JSON)")
    p.add_argument("--config", type=Path, default=None,
                   help="the base Serve config the map starts from and is compared with (default: shipped)")
    p.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    p.add_argument("--segments", default="code,summarize,chat", help="comma-separated workload names")
    p.add_argument("--concurrency", default=None, help="levels (default 1,2,4,8,16; --quick 1,4,16)")
    p.add_argument("--requests", type=int, default=16, help="requests per cell (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rows-per-segment", type=int, default=16, help="rows the map profiles per segment")
    p.add_argument("--map-minutes", type=float, default=None, help="bound the map run")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: levels {QUICK['levels']} (unless given), {QUICK['requests']} requests per cell, "
                        f"{QUICK['max_tokens']} tokens, map --quick")
    p.add_argument("--judge-only", action="store_true",
                   help="measure nothing: judge the map and the two bench serve runs already in --out again")


def split_workloads(workloads: Path, segments: list[str], out: Path) -> tuple[Path, Path, dict]:
    """(sample dir, held-out dir, rows per side): even rows of each segment's file to the sample,
    odd rows held out; every row keeps (or gets) its segment label."""
    sample, held = out / "sample", out / "heldout"
    sample.mkdir(parents=True, exist_ok=True)
    held.mkdir(parents=True, exist_ok=True)
    counts = {}
    for seg in segments:
        src = workloads / f"{seg}.jsonl"
        if not src.is_file():
            raise UserFacingError(f"no workload {seg!r}: {src} not found")
        rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
        for row in rows:
            row.setdefault("segment", seg)
        sides = (rows[0::2], rows[1::2])
        if not sides[1]:
            raise UserFacingError(f"workload {seg!r} has {len(rows)} row(s): nothing would be held out")
        for side, d in zip(sides, (sample, held)):
            (d / f"{seg}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in side))
        counts[seg] = {"sample": len(sides[0]), "heldout": len(sides[1])}
    return sample, held, counts


def _serve_bench(args, config: Path, workloads: Path, json_path: Path) -> dict:
    from cluster.bench import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    argv = ["--json", str(json_path), "--config", str(config), "--workloads", str(workloads),
            "--segments", args.segments, "--concurrency", args.concurrency,
            "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
            "--overhead-requests", "0"]
    rc = serve.run(p.parse_args(argv))
    if rc != 0:
        raise RuntimeError(f"bench serve with {config} exited {rc}")
    return json.loads(json_path.read_text())


def _cells(report: dict) -> dict[tuple[str, int, str], dict]:
    return {(c["segment"], c["concurrency"], c["policy"]): c for c in report["cells"]}


def _measured_crossover(cells: dict, segment: str, levels: list[int]) -> dict:
    from cluster.mapper.crossover import find_crossover

    got = [(c, cells[(segment, c, "fixed_spec")]["e2e_p50"], cells[(segment, c, "fixed_plain")]["e2e_p50"])
           for c in levels if (segment, c, "fixed_spec") in cells and (segment, c, "fixed_plain") in cells]
    got = [(c, s, p) for c, s, p in got if s and p]
    if not got:
        return {"kind": None, "value": None}
    x = find_crossover([c for c, _, _ in got], [s / p for _, s, p in got])
    return {"kind": x.kind.value, "value": x.value}


def _level_distance(a: float, b: float, levels: list[int]) -> float:
    """How many concurrency levels apart ``a`` and ``b`` lie (log2 spacing of the levels run)."""
    steps = [math.log2(levels[i + 1] / levels[i]) for i in range(len(levels) - 1)] or [1.0]
    return abs(math.log2(a) - math.log2(b)) / (sum(steps) / len(steps))


def crossover_check(mapped: dict | None, measured: dict, levels: list[int]) -> dict:
    """The map's crossover for a segment (its measured one if it crossed within the levels it ran,
    else its cost model's prediction — beyond the highest level its sweep ran, where its sweep saw
    speculation still winning: a prediction below that contradicts the map's own measurement)
    against the held-out one; both "never crossed within the levels" count as agreeing, and a map
    that never crossed up to level L agrees with a held-out crossing at L/2 or above."""
    if mapped is None or measured["kind"] is None:
        return {"within_one_level": None, "why": "no crossover to compare"}
    cross = mapped.get("crossover") or {}
    predicted = mapped.get("predicted_crossover")
    map_top = max(mapped.get("levels") or levels)
    if cross.get("kind") in ("within", "below"):
        value = cross.get("value")
    elif cross.get("kind") == "above":
        value = predicted if predicted is not None and predicted > map_top else None
    else:  # no sweep: the cost model alone
        value = predicted
    if measured["kind"] == "above":
        ok = value is None or value >= levels[-1] / 2
        return {"map": value, "heldout": None, "within_one_level": ok}
    if value is None:
        ok = cross.get("kind") == "above" and measured["value"] >= map_top / 2
        return {"map": f"> {map_top}" if cross.get("kind") == "above" else None, "heldout": measured["value"],
                "within_one_level": ok}
    dist = _level_distance(float(value), float(measured["value"]), levels)
    return {"map": value, "heldout": measured["value"], "levels_apart": round(dist, 2),
            "within_one_level": dist <= 1.0}


def judge(mapped_report: dict, shipped_report: dict, decision: dict, levels: list[int]) -> list[dict]:
    """Per (segment, concurrency): the mapped routed p50 over the better fixed policy (same run),
    over the shipped routed p50 (with a 90% interval), and per segment the crossover check."""
    mc, sc = _cells(mapped_report), _cells(shipped_report)
    rows = []
    for seg, conc in sorted({(s, c) for s, c, _ in mc}):
        routed = mc.get((seg, conc, "routed"))
        fixed = {p: mc[(seg, conc, p)]["e2e_p50"] for p in ("fixed_spec", "fixed_plain")
                 if (seg, conc, p) in mc and mc[(seg, conc, p)]["e2e_p50"]}
        shipped = sc.get((seg, conc, "routed"))
        if not routed or not routed["e2e_p50"] or not fixed:
            continue
        best = min(fixed, key=fixed.get)
        row = {"segment": seg, "concurrency": conc, "best_fixed": best,
               "mapped_over_best_fixed": round(routed["e2e_p50"] / fixed[best], 4),
               "mapped_route_mix": routed.get("route_mix")}
        row["meets_goal"] = row["mapped_over_best_fixed"] <= MAPPED_GOAL
        # the same comparison with its noise: routed on the best fixed policy's path for every
        # request still differs from it by run-to-run noise (a few % here)
        ci_best = ratio_interval(routed.get("e2e_s") or [], [mc[(seg, conc, best)].get("e2e_s") or []])
        row["mapped_over_best_fixed_ci90"] = list(ci_best) if ci_best else None
        row["best_fixed_within_noise"] = bool(ci_best) and ci_best[0] <= MAPPED_GOAL
        if shipped and shipped["e2e_p50"]:
            row["mapped_over_shipped"] = round(routed["e2e_p50"] / shipped["e2e_p50"], 4)
            ci = ratio_interval(routed.get("e2e_s") or [], [shipped.get("e2e_s") or []])
            row["mapped_over_shipped_ci90"] = list(ci) if ci else None
            row["not_worse_than_shipped"] = bool(ci) and ci[0] <= 1.0
            row["shipped_route_mix"] = shipped.get("route_mix")
        rows.append(row)
    for seg in sorted({r["segment"] for r in rows}):
        check = crossover_check((decision.get("segments") or {}).get(seg), _measured_crossover(mc, seg, levels),
                                levels)
        for r in rows:
            if r["segment"] == seg:
                r["crossover"] = check
    return rows


def format_table(rows: list[dict]) -> str:
    out = ["segment        c  best fixed   mapped/best  mapped/shipped (90%)     goal  crossover map/held-out"]
    for r in rows:
        ci = r.get("mapped_over_shipped_ci90") or [None, None]
        x = r.get("crossover") or {}
        out.append(f"{r['segment']:<12} {r['concurrency']:>3}  {r['best_fixed']:<11} "
                   f"{r['mapped_over_best_fixed']:>10.3f}  {r.get('mapped_over_shipped', float('nan')):>6.3f} "
                   f"({ci[0]}-{ci[1]})  {'ok' if r['meets_goal'] else 'MISS':>5}  "
                   f"{x.get('map')}/{x.get('heldout')} {'ok' if x.get('within_one_level') else 'MISS'}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    from deployments.local import DEFAULT_CONFIG
    from cluster.mapper.run import MapPlan, map_workload

    args.concurrency = args.concurrency or (QUICK["levels"] if args.quick else "1,2,4,8,16")
    if args.quick:
        args.requests = min(args.requests, QUICK["requests"])
        args.max_tokens = min(args.max_tokens, QUICK["max_tokens"])
        args.rows_per_segment = min(args.rows_per_segment, QUICK["rows_per_segment"])
    levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    base = args.config or Path(DEFAULT_CONFIG)
    segments = [s.strip() for s in args.segments.split(",") if s.strip()]
    t0 = time.perf_counter()
    if args.judge_only:  # a finished run's files, judged again (e.g. after a fix to the judging)
        found = [args.out / "map" / "map.json", args.out / "serve_mapped.json", args.out / "serve_shipped.json"]
        missing = [str(f) for f in found if not f.is_file()]
        if missing:
            raise UserFacingError(f"--judge-only needs a finished run in {args.out}; missing {missing}")
        state, mapped, shipped = (json.loads(f.read_text()) for f in found)
        counts = {seg: {side: sum(1 for line in (args.out / side / f"{seg}.jsonl").read_text().splitlines() if line.strip())
                        for side in ("sample", "heldout")} for seg in segments}
    else:
        sample, held, counts = split_workloads(args.workloads, segments, args.out)
        print(f"map sample {sample}, held out {held}: {counts}", file=sys.stderr, flush=True)
        state = map_workload(MapPlan(traffic=sample, out=args.out / "map", config=base, quick=args.quick,
                                     max_minutes=args.map_minutes, levels=levels, requests=args.requests,
                                     rows_per_segment=args.rows_per_segment, max_tokens=args.max_tokens,
                                     progress=False))
        mapped_cfg = args.out / "map" / "serve_config.yaml"
        if not mapped_cfg.is_file():
            print(f"the map wrote no config ({state.get('failed') or 'see map.json'})", file=sys.stderr)
            return 1
        mapped = _serve_bench(args, mapped_cfg, held, args.out / "serve_mapped.json")
        shipped = _serve_bench(args, base, held, args.out / "serve_shipped.json")
    rows = judge(mapped, shipped, state.get("decision") or {}, levels)
    report = {"version": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "judge_only": args.judge_only,
              "base_config": str(base), "segments": segments, "levels": levels, "rows_split": counts,
              "map_partial": bool(state.get("partial")), "mapped_knobs": (state.get("decision") or {}).get("knobs"),
              "cells": rows, "elapsed_s": round(time.perf_counter() - t0, 1),
              "goals": {"mapped_over_best_fixed_max": MAPPED_GOAL,
                        "cells_meeting": sum(r["meets_goal"] for r in rows),
                        "cells_within_noise_of_best_fixed": sum(bool(r.get("best_fixed_within_noise")) for r in rows),
                        "cells_not_worse_than_shipped": sum(bool(r.get("not_worse_than_shipped")) for r in rows),
                        "segments_crossover_within_one_level": sorted(
                            {r["segment"] for r in rows if (r.get("crossover") or {}).get("within_one_level")}),
                        "cells": len(rows)},
              "mapped_median_over_best_fixed": percentile([r["mapped_over_best_fixed"] for r in rows], 0.5)}
    print(format_table(rows), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0
