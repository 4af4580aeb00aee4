"""Phase 2 of ``specserve map``: the concurrency sweep through the real service.

Owns: per segment and concurrency level (1, 2, 4, ... by default), fixed-speculative (mode
SPECULATIVE) and fixed-plain (mode PLAIN) side by side in rounds with the order rotating (the
method of ``bench serve``, whose request, cell and interval helpers it calls), so that a slow
stretch of a shared machine hits both paths alike; per cell TTFT, TPOT, e2e p50/p99, tokens/s and
α; each path's rows in draft scopes of its own (``map-<run>/<path>/c<pass>``, a new one each pass
over the sample: ``scoped_rows``), so a drafter that learns from traffic never drafts a row from
its own earlier answer to it, nor from the live traffic of a running service (whose shared memory
the sweep leaves alone); and stopping a segment early once plain wins clearly (the 90% bootstrap interval of
spec p50 / plain p50 lies above 1 and the ratio is at least ``CLEAR_RATIO``): higher levels only
widen the gap and cost minutes. Ignores: starting the service (the command does) and the choices
(phase 3).
"""
from __future__ import annotations

import time

from cluster.bench import serve as bench
from cluster.bench.repeats import SpecAnswers, level_start, scoped_rows
from cluster.mapper.progress import Budget, OutOfTime
from cluster.mapper.traffic import Traffic

PATHS = ("fixed_spec", "fixed_plain")
CLEAR_RATIO = 1.10  # spec p50 / plain p50 at least this, with its interval above 1: plain wins clearly


def plain_wins_clearly(spec_e2e: list[float], plain_e2e: list[float], spec_p50: float | None,
                       plain_p50: float | None) -> bool:
    if not spec_p50 or not plain_p50 or spec_p50 / plain_p50 < CLEAR_RATIO:
        return False
    ci = bench.ratio_interval(spec_e2e, [plain_e2e])
    return ci is not None and ci[0] > 1.0


def run_sweep(addr: str, app_name: str, traffic: Traffic, levels: list[int], requests: int,
              max_tokens: int, budget: Budget, result: dict, token: str | None = None,
              drafter: str | None = None) -> dict:
    """Fill ``result['cells']`` (one dict per segment, level and path, ``bench serve``'s cell
    format) as cells complete; ``result['stopped_early']``: segment -> the level plain won at;
    ``result['repeated_rows']``: how many speculative requests repeated a row answered before
    (``cluster.bench.repeats``; each level takes fresh rows while the sample lasts;
    ``drafter``: the service's, to say whether a repeat matters)."""
    import grpc

    from cluster.api import stubs

    pb2 = stubs.generation_pb2()
    md = [("application", app_name)] + ([("authorization", f"Bearer {token}")] if token else [])
    cells = result.setdefault("cells", [])
    early = result.setdefault("stopped_early", {})
    result.update(levels=list(levels), requests_per_cell=requests, max_tokens=max_tokens, addr=addr)
    answers = SpecAnswers()
    scope = bench.run_scope("map")
    t0 = time.perf_counter()
    total = len(traffic.segments) * len(levels) * len(PATHS)
    try:
        with grpc.insecure_channel(addr) as channel, budget.phase("phase 2/3 sweep", total) as bar:
            stub = stubs.generation_grpc().GenerationStub(channel)
            for segment, sample in traffic.segments.items():
                needed = bench.rows_sent(requests, levels, 0)
                by_path = {p: scoped_rows(sample, f"{scope}/{p}", needed) for p in PATHS}
                start = 0  # each level's rows: fresh ones while the sample lasts
                for i, c in enumerate(levels):
                    budget.check()
                    per = {p: ([], 0.0, 0) for p in PATHS}
                    rounds, n_round = bench.round_plan(requests, c, 0)
                    for r in range(rounds):
                        budget.check()  # a half-measured cell is dropped, not recorded
                        for path in bench.round_order(list(PATHS), r):
                            # untimed: the engine may have sat idle while the other path ran
                            bench.stream_one(stub, pb2, md, bench.WARM_UP_ROW, bench.POLICIES[path], 1)
                            offset = start + r * n_round
                            rows = by_path[path]
                            res, wall = bench.run_requests(stub, pb2, md, rows, bench.POLICIES[path], c,
                                                           n_round, max_tokens, offset=offset)
                            repeated = answers.wave(bench.wave_rows(rows, offset, n_round, c), res,
                                                    forced_speculative=path == "fixed_spec")
                            per[path] = (per[path][0] + res, per[path][1] + wall, per[path][2] + repeated)
                    start = level_start(start, rounds, n_round)
                    got = {}
                    for path in PATHS:
                        cell = bench.cell_stats(*per[path][:2])
                        cell.update(segment=segment, concurrency=c, policy=path, repeated_rows=per[path][2])
                        cells.append(cell)
                        got[path] = cell
                    bar.update(len(PATHS))
                    s, p = got["fixed_spec"], got["fixed_plain"]
                    if plain_wins_clearly(s["e2e_s"], p["e2e_s"], s["e2e_p50"], p["e2e_p50"]):
                        early[segment] = c
                        bar.update(len(PATHS) * (len(levels) - i - 1))
                        break
    except OutOfTime as exc:
        result["stopped"] = str(exc)
    finally:
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        result["repeated_rows"] = answers.summary(drafter)
    return result
