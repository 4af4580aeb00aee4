"""`specserve bench shaping`: what shaping the target's logits costs, and whether speculation still
pays under it, side by side on both paths.

Owns: per workload prompt and round, one greedy request through an ``LLMEngine`` on the real target
for each path (``plain``; ``spec``: ``--drafter`` at auto K) and each shaping (``none``;
``penalties``: presence 0.5 and frequency 0.5; ``bias``: +1 on 50 token ids; ``min_tokens``: half
the budget; ``repetition``: repetition_penalty 1.2 over prompt and output; ``temp_0.7`` and
``temp_1``: sampled at that temperature, seeded — the same seed on both paths, from the prompt and
round — so that the two paths' tokens are comparable: OpenAI's clients sample at temperature 1 unless
told otherwise), the shapings in a rotating order (``--shapings``: a subset, ``none`` always in it);
each shaping's spec tokens checked against its plain tokens (speculation verifies against the
shaped target: any difference is reported and fails the run). Reported per segment: the
median over prompts and rounds of each shaping's tokens/s over the ``none`` run of the same prompt,
round and path (what the shaping costs; its output differs, so this is per token), and of spec
tokens/s over plain tokens/s for the same prompt, round and shaping (whether speculation still pays
under it), pooled tokens/s, and the spec path's acceptance (accepted draft tokens over drafted, and
drafted tokens per output token). Prints a table and writes JSON. Ignores: concurrency (one request
at a time), unseeded sampling (its tokens differ from path to path; rejection sampling's acceptance
of a one-hot draft token is the seeded path's, p of the token), the service.
"""
from __future__ import annotations

import argparse
import sys
import time
import zlib

from cluster.bench.side_by_side import (add_side_by_side_arguments, both_paths, load_target, median, prompt_walk,
                                        report, write_report)

BIASED_IDS = range(1000, 1050)  # ordinary tokens of SmolLM2's vocabulary, none special
SHAPINGS = ("none", "penalties", "bias", "min_tokens", "repetition", "temp_0.7", "temp_1")
TEMPERATURES = {"temp_0.7": 0.7, "temp_1": 1.0}
PATHS = ("plain", "spec")


def shaped(params, shaping: str, seed: int = 0):
    """``params`` (a fresh request's) with ``shaping`` applied (a sampled one seeded with ``seed``)."""
    if shaping == "penalties":
        params.presence_penalty, params.frequency_penalty = 0.5, 0.5
    elif shaping == "bias":
        params.logit_bias = tuple((t, 1.0) for t in BIASED_IDS)
    elif shaping == "min_tokens":
        params.min_tokens = params.max_tokens // 2
    elif shaping == "repetition":
        params.repetition_penalty = 1.2
    elif shaping in TEMPERATURES:
        params.temperature, params.seed = TEMPERATURES[shaping], seed
    return params


def request_seed(prompt_id: str, rnd: int) -> int:
    """The seed of a prompt's sampled runs in a round: the same on both paths and for each shaping."""
    return zlib.crc32(f"{prompt_id}/r{rnd}".encode())


def chosen_shapings(text: str) -> tuple[str, ...]:
    """``--shapings``: the named ones in SHAPINGS' order; ``none`` (every ratio's baseline) must be among them."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SHAPINGS))
    if unknown or "none" not in names:
        raise argparse.ArgumentTypeError(f"shapings must include none and come from {', '.join(SHAPINGS)}"
                                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return tuple(n for n in SHAPINGS if n in names)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_side_by_side_arguments(p, "code,chat,json", "the spec path's drafter (K: auto)")
    p.add_argument("--shapings", type=chosen_shapings, default=SHAPINGS,
                   help=f"comma-separated shapings to run (default: all of {','.join(SHAPINGS)}; none is required)")


def run(args: argparse.Namespace) -> int:
    from cluster.bench.timed_run import request_for, run_ours

    target, segments = load_target(args)
    engines = both_paths(target, args.drafter)
    runs: list[dict] = []
    mismatches: list[str] = []
    t_start = time.perf_counter()
    for rnd, seg, row, ids, max_tokens, order in prompt_walk(args, target, segments, args.shapings):
        for shaping in order:
            outputs = {}
            for path in PATHS:
                req = request_for(f"{row['id']}-r{rnd}-{path}-{shaping}", ids, max_tokens, seg)
                shaped(req.params, shaping, request_seed(row["id"], rnd))
                req.draft_scope = f"bench-shaping/r{rnd}/{path}/{shaping}"  # no run drafts from another's answer
                r = run_ours(engines[path], req)
                outputs[path] = r.ids
                runs.append(dict(round=rnd, segment=seg, prompt=row["id"], path=path, shaping=shaping,
                                 tokens=r.tokens, wall_s=r.wall_s, draft_tokens=r.draft_tokens,
                                 accepted_tokens=r.accepted_tokens))
                print(f"r{rnd} {seg} {row['id']} {path} {shaping}: {r.tokens / r.wall_s:.1f} tok/s",
                      file=sys.stderr, flush=True)
            if outputs["spec"] != outputs["plain"]:
                mismatches.append(f"{row['id']}-r{rnd}-{shaping}")
    result = build_report(args, segments, runs, mismatches, time.perf_counter() - t_start)
    return write_report(args, result, format_table(result))


def build_report(args: argparse.Namespace, segments: list[str], runs: list[dict], mismatches: list[str],
                 seconds: float) -> dict:
    """Per segment (and ``all``) and shaping: each path's median tokens/s ratio to its ``none``
    run, the median spec-over-plain ratio, and pooled tokens/s per path."""
    by_key = {(r["round"], r["prompt"], r["path"], r["shaping"]): r for r in runs}

    def rate(r: dict | None) -> float:
        return r["tokens"] / r["wall_s"] if r and r["wall_s"] > 0 else 0.0

    table: dict[str, dict] = {}
    for seg in [*segments, "all"]:
        table[seg] = {}
        for shaping in args.shapings:
            mine = [r for r in runs if r["shaping"] == shaping and seg in ("all", r["segment"])]
            cell: dict = {}
            for path in PATHS:
                own = [r for r in mine if r["path"] == path]
                ratios = [rate(r) / rate(b) for r in own
                          if rate(b := by_key.get((r["round"], r["prompt"], path, "none"))) > 0]
                cell[path] = {"runs": len(own), "vs_none": median(ratios),
                              "pooled_tok_per_s": round(sum(r["tokens"] for r in own) / sum(r["wall_s"] for r in own), 2)
                              if own else None}
            speedups = [rate(r) / rate(p) for r in mine if r["path"] == "spec"
                        if rate(p := by_key.get((r["round"], r["prompt"], "plain", shaping))) > 0]
            cell["spec_over_plain"] = median(speedups)
            spec = [r for r in mine if r["path"] == "spec"]
            drafted, tokens = sum(r.get("draft_tokens", 0) for r in spec), sum(r["tokens"] for r in spec)
            cell["spec"]["acceptance"] = round(sum(r.get("accepted_tokens", 0) for r in spec) / drafted, 3) if drafted else None
            cell["spec"]["drafted_per_token"] = round(drafted / tokens, 3) if tokens else None
            table[seg][shaping] = cell
    return report(args, "shaping", seconds, mismatches, table, runs)


def format_table(report: dict) -> str:
    lines = [f"bench shaping: spec path drafter {report['drafter']}, {report['rounds']} round(s); medians over "
             f"prompts and rounds: each path's tok/s relative to the same prompt's run without shaping, and "
             f"spec tok/s over plain tok/s [pooled tok/s plain / spec]; the spec path's accepted / drafted "
             f"tokens and drafted tokens per output token; spec tokens = plain tokens: {report['lossless']}",
             f"{'segment':<8} {'shaping':<11} {'plain/none':>11} {'spec/none':>10} {'spec/plain':>11} {'pooled':>14} "
             f"{'accepted':>9} {'drafted':>8}"]

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for seg, shapings in report["table"].items():
        for shaping, c in shapings.items():
            pooled = f"{c['plain']['pooled_tok_per_s'] or 0:.1f} / {c['spec']['pooled_tok_per_s'] or 0:.1f}"
            lines.append(f"{seg:<8} {shaping:<11} {num(c['plain']['vs_none']):>11} {num(c['spec']['vs_none']):>10} "
                         f"{num(c['spec_over_plain']):>11} {pooled:>14} {num(c['spec'].get('acceptance')):>9} "
                         f"{num(c['spec'].get('drafted_per_token')):>8}")
    return "\n".join(lines)
