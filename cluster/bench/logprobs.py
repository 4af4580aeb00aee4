"""`specserve bench logprobs`: what asking for log-probabilities costs, side by side on both paths.

Owns: per workload prompt and round, one greedy request through an ``LLMEngine`` on the real
target for each path (``plain``; ``spec``: ``--drafter`` at auto K) and each ask (``none``;
``logprobs 0``: each token's own; ``logprobs 20``: and the 20 most likely), the asks in a rotating
order; every run's tokens checked against the path's ``none`` run (asking changes no token: any
difference is reported and fails the run). Reported per segment and path: the median over prompts
and rounds of each ask's tokens/s over the ``none`` run of the same prompt, round and path, and
pooled tokens/s. Prints a table and writes JSON.
Ignores: concurrency (one request at a time), sampling, the service's transport of the values.
"""
from __future__ import annotations

import argparse
import sys
import time

from cluster.bench.side_by_side import (add_side_by_side_arguments, both_paths, load_target, median, prompt_walk,
                                        report, write_report)

ASKS = {"none": None, "logprobs0": 0, "logprobs20": 20}
PATHS = ("plain", "spec")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_side_by_side_arguments(p, "code,chat,json", "the spec path's drafter (K: auto)")


def run(args: argparse.Namespace) -> int:
    from cluster.bench.timed_run import request_for, run_ours

    target, segments = load_target(args)
    engines = both_paths(target, args.drafter)
    runs: list[dict] = []
    mismatches: list[str] = []
    t_start = time.perf_counter()
    for rnd, seg, row, ids, max_tokens, asks in prompt_walk(args, target, segments, tuple(ASKS)):
        for path in PATHS:
            outputs = {}
            for ask in asks:
                req = request_for(f"{row['id']}-r{rnd}-{path}-{ask}", ids, max_tokens, seg)
                req.params.logprobs = ASKS[ask]
                req.draft_scope = f"bench-logprobs/r{rnd}/{path}/{ask}"  # no run drafts from another's answer
                r = run_ours(engines[path], req)
                outputs[ask] = r.ids
                runs.append(dict(round=rnd, segment=seg, prompt=row["id"], path=path, ask=ask,
                                 tokens=r.tokens, wall_s=r.wall_s))
                print(f"r{rnd} {seg} {row['id']} {path} {ask}: {r.tokens / r.wall_s:.1f} tok/s",
                      file=sys.stderr, flush=True)
            mismatches += [f"{row['id']}-r{rnd}-{path}-{a}" for a in asks if outputs[a] != outputs["none"]]
    result = build_report(args, segments, runs, mismatches, time.perf_counter() - t_start)
    return write_report(args, result, format_table(result))


def build_report(args: argparse.Namespace, segments: list[str], runs: list[dict], mismatches: list[str],
                 seconds: float) -> dict:
    """Per segment and path: each ask's median tokens/s ratio to the same prompt, round and path's
    ``none`` run, and pooled tokens/s; ``all``: the ratios over every segment."""
    by_key = {(r["round"], r["prompt"], r["path"], r["ask"]): r for r in runs}

    def rate(r: dict) -> float:
        return r["tokens"] / r["wall_s"] if r["wall_s"] > 0 else 0.0

    table: dict[str, dict] = {}
    for seg in [*segments, "all"]:
        table[seg] = {}
        for path in PATHS:
            cells = {}
            for ask in ASKS:
                mine = [r for r in runs if r["path"] == path and r["ask"] == ask and seg in ("all", r["segment"])]
                ratios = [rate(r) / rate(b) for r in mine
                          if (b := by_key.get((r["round"], r["prompt"], path, "none"))) and rate(b) > 0]
                cells[ask] = {"runs": len(mine), "vs_none": median(ratios),
                              "pooled_tok_per_s": round(sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine), 2)
                              if mine else None}
            table[seg][path] = cells
    return report(args, "logprobs", seconds, mismatches, table, runs)


def format_table(report: dict) -> str:
    lines = [f"bench logprobs: spec path drafter {report['drafter']}, {report['rounds']} round(s); medians over "
             f"prompts and rounds of tok/s relative to the same prompt's run without logprobs [pooled tok/s]; "
             f"lossless: {report['lossless']}",
             f"{'segment':<8} {'path':<6} " + " ".join(f"{a:>22}" for a in ASKS)]
    for seg, paths in report["table"].items():
        for path, cells in paths.items():
            def cell(c: dict) -> str:
                return "-" if c["vs_none"] is None else f"{c['vs_none']:.3f} [{c['pooled_tok_per_s']:.1f}]"
            lines.append(f"{seg:<8} {path:<6} " + " ".join(f"{cell(cells[a]):>22}" for a in ASKS))
    return "\n".join(lines)
