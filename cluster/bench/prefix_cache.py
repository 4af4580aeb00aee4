"""`specserve bench prefix_cache`: what the prefix cache buys a conversation's next turn, side by side.

Owns: per workload prompt and round, a two-turn conversation on two engines — ``cold`` (prefix
caching off) and ``warm`` (on), both plain or both speculative with ``--drafter`` at auto K
(``--path spec``; the default drafter's EAGLE head takes a shared prefix's features from the
cache) — each first answering the prompt (turn 1, not timed),
then answering the conversation continued: the prompt, that answer and a follow-up user turn
through the chat template (turn 2, timed: time to first token and to the end), the engines in a
rotating order. Checked: turn 2's greedy tokens are the same on both engines (a difference is
reported and fails the run), and the warm engine's turn 2 found its prompt's full blocks up to
turn 1's committed tokens (``cached``). Reported per segment: medians of warm / cold time to first
token and end-to-end time, and the share of turn 2's prompt that came from the cache. Prints a
table and writes JSON.
Ignores: concurrency (one request at a time), eviction under memory pressure (the pool holds
every turn here).
"""
from __future__ import annotations

import argparse
import sys
import time

from cluster.bench.side_by_side import (add_side_by_side_arguments, load_target, median, prompt_walk, ratio_text,
                                        report, write_report)

VARIANTS = ("cold", "warm")
FOLLOW_UP = "Thank you. Now say it again in one short sentence."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_side_by_side_arguments(p, "chat,edit,json", "both engines' drafter with --path spec (auto K)")
    p.add_argument("--path", choices=("plain", "spec"), default="plain",
                   help="both engines plain, or both speculative with --drafter")
    p.add_argument("--turn2-tokens", type=int, default=16, help="tokens of the timed second turn")


def _turn(engine, req) -> tuple[float, float, list[int], int]:
    """(seconds to the first token, to the end, output ids, prompt tokens from the cache)."""
    t0 = time.perf_counter()
    first, ids, cached = None, [], 0
    engine.add_request(req)
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            ids += out.new_token_ids
            cached = out.num_cached_tokens if out.finished else cached
    end = time.perf_counter() - t0
    return first if first is not None else end, end, ids, cached


def _second_turn(tokenizer, row: dict, answer: str) -> list[int]:
    from cluster.models.tokenizer import chat_token_ids

    return chat_token_ids(tokenizer, [{"role": "user", "content": row["prompt"]},
                                      {"role": "assistant", "content": answer},
                                      {"role": "user", "content": FOLLOW_UP}])


def run(args: argparse.Namespace) -> int:
    from cluster.bench.timed_run import engine_for, request_for
    from cluster.common.config import SpecConfig

    target, segments = load_target(args)
    spec = SpecConfig(drafter=args.drafter, num_draft_tokens="auto") if args.path == "spec" else None
    engines = {"cold": engine_for(target, spec, prefix_caching=False), "warm": engine_for(target, spec)}
    runs: list[dict] = []
    mismatches: list[str] = []
    t_start = time.perf_counter()
    for rnd, seg, row, ids, max_tokens, order in prompt_walk(args, target, segments, VARIANTS):
        if not row.get("chat"):
            continue  # a conversation needs the chat template
        rid = f"{row['id']}-r{rnd}"
        got: dict[str, dict] = {}
        for variant in order:
            engine = engines[variant]
            _, _, answer, _ = _turn(engine, request_for(f"{rid}-{variant}-1", ids, max_tokens, seg))
            text = target.tokenizer.decode([t for t in answer if t not in target.eos_token_ids])
            # the chat template renders turn 1 as it was fed: turn 2's prompt starts with it
            turn2 = _second_turn(target.tokenizer, row, text)
            ttft, e2e, out, cached = _turn(engine, request_for(f"{rid}-{variant}-2", turn2, args.turn2_tokens, seg))
            got[variant] = dict(ttft_s=ttft, e2e_s=e2e, ids=out, cached=cached, prompt_tokens=len(turn2))
        if got["cold"]["ids"] != got["warm"]["ids"]:
            mismatches.append(f"{rid}: turn 2 differs with the prefix cache")
        runs.append(dict(round=rnd, segment=seg, prompt=row["id"], prompt_tokens=got["warm"]["prompt_tokens"],
                         cached_tokens=got["warm"]["cached"], cold_cached=got["cold"]["cached"],
                         **{f"{v}_{k}": got[v][k] for v in VARIANTS for k in ("ttft_s", "e2e_s")}))
        print(f"r{rnd} {seg} {row['id']}: turn 2 of {got['warm']['prompt_tokens']} tokens, {got['warm']['cached']} "
              f"cached: first token {got['warm']['ttft_s'] * 1e3:.0f} ms warm vs {got['cold']['ttft_s'] * 1e3:.0f} ms "
              f"cold", file=sys.stderr, flush=True)
    result = build_report(args, segments, runs, mismatches, time.perf_counter() - t_start)
    return write_report(args, result, format_table(result))


def build_report(args: argparse.Namespace, segments: list[str], runs: list[dict], mismatches: list[str],
                 seconds: float) -> dict:
    table: dict[str, dict] = {}
    for seg in [*segments, "all"]:
        mine = [r for r in runs if seg in ("all", r["segment"])]
        table[seg] = {
            "runs": len(mine),
            "ttft_warm_vs_cold": median([r["warm_ttft_s"] / r["cold_ttft_s"] for r in mine]),
            "e2e_warm_vs_cold": median([r["warm_e2e_s"] / r["cold_e2e_s"] for r in mine]),
            "cached_share": median([r["cached_tokens"] / r["prompt_tokens"] for r in mine]),
            "prompt_tokens": median([r["prompt_tokens"] for r in mine]),
        }
    return report(args, "prefix_cache", seconds, mismatches, table, runs, turn2_tokens=args.turn2_tokens,
                  follow_up=FOLLOW_UP, path=args.path, drafter=args.drafter if args.path == "spec" else None)


def format_table(report_: dict) -> str:
    path = report_.get("path", "plain") + (f" ({report_['drafter']})" if report_.get("drafter") else "")
    lines = [f"bench prefix_cache: {report_['rounds']} round(s), {path} path, turn 2 of a conversation; medians of "
             f"warm (prefix cache) / cold wall times; turn 2 the same on both: {report_['lossless']}",
             f"{'segment':<12} {'runs':>4} {'ttft warm/cold':>15} {'e2e warm/cold':>14} {'cached share':>13} "
             f"{'prompt tokens':>14}"]

    for seg, c in report_["table"].items():
        lines.append(f"{seg:<12} {c['runs']:>4} {ratio_text(c['ttft_warm_vs_cold']):>15} {ratio_text(c['e2e_warm_vs_cold']):>14} "
                     f"{ratio_text(c['cached_share']):>13} {ratio_text(c['prompt_tokens']):>14}")
    return "\n".join(lines)
