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
With ``--burst N``: per workload prompt and round, N chat requests that share it as their system
prompt and differ in their user question, all added to the engine at once (one scheduling step
admits as many as its token budget holds: those after the first share the system prompt's blocks
the same step fills — ``KVCacheManager.index_scheduled`` — or, admitted later, the blocks it
committed), timed from the burst's start to each request's first token and to the last one's
end, cold then warm in a rotating order, each burst on a fresh engine (an empty cache). Checked: every
request's greedy tokens are the same on
both engines. Reported per segment: medians of warm / cold mean time to first token and time to
the burst's end, and the share of the burst's prompt tokens that came from the cache.
With ``--placement separate`` (``--path spec``, a model drafter: ``eagle``): the drafter runs in a
DraftServer on 127.0.0.1 (a KVSync gRPC server in this process, as the service's DraftServer
deployment hosts it), each engine its client (``RemoteProposer``); a shared prefix's features
reach the DraftServer from the engine's feature buffer.
Ignores: eviction under memory pressure (the pool holds every turn here), arrivals spread in time.
"""
from __future__ import annotations

import argparse
import sys
import time

from cluster.bench.side_by_side import (add_side_by_side_arguments, load_target, median, prompt_walk, ratio_text,
                                        report, write_report)

VARIANTS = ("cold", "warm")
FOLLOW_UP = "Thank you. Now say it again in one short sentence."
BURST_QUESTIONS = ("Answer in one sentence.", "What is the first step?", "Give one example.",
                   "What could go wrong?", "Say it to a child.", "What is the key term here?",
                   "Summarise it in five words.", "Why does it matter?")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_side_by_side_arguments(p, "chat,edit,json", "both engines' drafter with --path spec (auto K)")
    p.add_argument("--path", choices=("plain", "spec"), default="plain",
                   help="both engines plain, or both speculative with --drafter")
    p.add_argument("--placement", choices=("shared", "separate"), default="shared",
                   help="with --path spec: the drafter in the engine, or in a DraftServer on 127.0.0.1 (KVSync)")
    p.add_argument("--turn2-tokens", type=int, default=16, help="tokens of the timed second turn (each burst request's)")
    p.add_argument("--burst", type=int, default=0, choices=range(0, len(BURST_QUESTIONS) + 1), metavar="N",
                   help=f"N (2 to {len(BURST_QUESTIONS)}) requests at once under each prompt as their system prompt, "
                        "instead of a conversation's second turn")


def _turn(engine, req) -> tuple[float, float, list[int], int]:
    """One request alone: (seconds to the first token, to the end, output ids, prompt tokens from the cache)."""
    (first,), end, ids, cached, _ = _burst(engine, [req])
    return first, end, ids[req.request_id], cached


def _burst(engine, reqs) -> tuple[list[float], float, dict[str, list[int]], int, int]:
    """All ``reqs`` added at once: (seconds to each one's first token, to the last one's end,
    output ids by request id, prompt tokens from the cache over all of them, draft tokens
    proposed for them)."""
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    ids: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    cached = drafted = 0
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            ids[out.request_id] += out.new_token_ids
            if out.finished:
                cached += out.num_cached_tokens
                drafted += out.spec.draft_tokens if out.spec is not None else 0
    end = time.perf_counter() - t0
    return [first.get(r.request_id, end) for r in reqs], end, ids, cached, drafted


def _burst_prompts(tokenizer, row: dict, n: int) -> list[list[int]]:
    from cluster.models.tokenizer import chat_token_ids

    return [chat_token_ids(tokenizer, [{"role": "system", "content": row["prompt"]}, {"role": "user", "content": q}])
            for q in BURST_QUESTIONS[:n]]


def _second_turn(tokenizer, row: dict, answer: str) -> list[int]:
    from cluster.models.tokenizer import chat_token_ids

    return chat_token_ids(tokenizer, [{"role": "user", "content": row["prompt"]},
                                      {"role": "assistant", "content": answer},
                                      {"role": "user", "content": FOLLOW_UP}])


def run(args: argparse.Namespace) -> int:
    from cluster.bench.timed_run import engine_for
    from cluster.common.config import SpecConfig

    if args.burst == 1:
        print("--burst needs at least 2 requests", file=sys.stderr)
        return 2
    if args.placement == "separate" and args.path != "spec":
        print("--placement separate needs --path spec (a drafter to place)", file=sys.stderr)
        return 2
    target, segments = load_target(args)
    spec = SpecConfig(drafter=args.drafter, num_draft_tokens="auto") if args.path == "spec" else None
    server, client = _draft_server(args, target) if args.placement == "separate" else (None, lambda: None)
    try:
        make = lambda caching: engine_for(target, spec, client(), prefix_caching=caching)  # noqa: E731
        if args.burst:
            return run_burst(args, target, segments, make)
        return run_turns(args, target, segments, make)
    finally:
        if server is not None:
            server.stop(0)


def _draft_server(args: argparse.Namespace, target):
    """Placement separate: a DraftServer core hosting ``--drafter`` behind a KVSync server on
    127.0.0.1; returns (the server, a maker of engine-side clients)."""
    from cluster.kvsync.client import RemoteProposer
    from cluster.kvsync.drafters import build_remote_proposer
    from cluster.kvsync.server import DraftServerCore, start_server
    from cluster.speculative.proposer import parse_drafter_choice

    draft, vocab = build_remote_proposer(parse_drafter_choice(args.drafter), args.model, "float32", target=target)
    server, port = start_server(DraftServerCore(draft, vocab_size=vocab, drafter=args.drafter), host="127.0.0.1")
    return server, lambda: RemoteProposer(f"127.0.0.1:{port}", expected_vocab_size=vocab)


def _close(engine) -> None:
    """An engine's DraftServer client (placement separate) closes its channel."""
    close = getattr(getattr(engine.spec, "proposer", None), "close", None)
    if close is not None:
        close()


def run_turns(args: argparse.Namespace, target, segments: list[str], engine_for) -> int:
    """``engine_for(prefix_caching)``: the two engines, each kept for the whole run."""
    engines: dict = {}
    try:
        engines = {"cold": engine_for(False), "warm": engine_for(True)}
        return _turns(args, target, segments, engines)
    finally:
        for engine in engines.values():
            _close(engine)


def _turns(args: argparse.Namespace, target, segments: list[str], engines: dict) -> int:
    from cluster.bench.timed_run import request_for

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


def run_burst(args: argparse.Namespace, target, segments: list[str], engine_for) -> int:
    """``engine_for(prefix_caching)``: a fresh engine, so each burst starts from an empty cache
    (a round's repeat of a prompt would otherwise find all of it cached)."""
    from cluster.bench.timed_run import request_for

    runs: list[dict] = []
    mismatches: list[str] = []
    t_start = time.perf_counter()
    warm_up = engine_for(False)
    _burst(warm_up, [request_for("warm-up", [1, 2, 3], 2, segments[0])])  # first-call costs, untimed
    _close(warm_up)
    for rnd, seg, row, _, _, order in prompt_walk(args, target, segments, VARIANTS):
        rid = f"{row['id']}-r{rnd}"
        prompts = _burst_prompts(target.tokenizer, row, args.burst)
        got: dict[str, dict] = {}
        for variant in order:
            reqs = [request_for(f"{rid}-{variant}-{j}", p, args.turn2_tokens, seg) for j, p in enumerate(prompts)]
            engine = engine_for(variant == "warm")
            try:
                firsts, end, ids, cached, drafted = _burst(engine, reqs)
                fallbacks = engine.stats().draft_fallbacks if engine.spec is not None else 0
            finally:
                _close(engine)
            got[variant] = dict(ttft_s=sum(firsts) / len(firsts), e2e_s=end, cached=cached, drafted=drafted,
                                fallbacks=fallbacks, ids=[ids[r.request_id] for r in reqs])
        if got["cold"]["ids"] != got["warm"]["ids"]:
            mismatches.append(f"{rid}: a burst request's tokens differ with the prefix cache")
        prompt_tokens = sum(len(p) for p in prompts)
        runs.append(dict(round=rnd, segment=seg, prompt=row["id"], prompt_tokens=prompt_tokens,
                         shared_prefix_tokens=_common_prefix(prompts), cached_tokens=got["warm"]["cached"],
                         cold_cached=got["cold"]["cached"],
                         **{f"{v}_{k}": got[v][k] for v in VARIANTS for k in ("ttft_s", "e2e_s", "drafted", "fallbacks")}))
        print(f"r{rnd} {seg} {row['id']}: burst of {args.burst}, {prompt_tokens} prompt tokens, {got['warm']['cached']} "
              f"cached: mean first token {got['warm']['ttft_s'] * 1e3:.0f} ms warm vs {got['cold']['ttft_s'] * 1e3:.0f} "
              f"ms cold", file=sys.stderr, flush=True)
    result = build_report(args, segments, runs, mismatches, time.perf_counter() - t_start)
    return write_report(args, result, format_table(result))


def _common_prefix(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


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
    mode = {"burst": args.burst, "burst_questions": list(BURST_QUESTIONS[:args.burst])} if args.burst else {
        "follow_up": FOLLOW_UP}
    spec = args.path == "spec"
    return report(args, "prefix_cache", seconds, mismatches, table, runs, turn2_tokens=args.turn2_tokens, **mode,
                  path=args.path, placement=args.placement if spec else None, drafter=args.drafter if spec else None)


def format_table(report_: dict) -> str:
    path = report_.get("path", "plain") + (f" ({report_['drafter']})" if report_.get("drafter") else "")
    if report_.get("placement") == "separate":
        path += " in a DraftServer"
    what = (f"bursts of {report_['burst']} requests under one system prompt (ttft: the burst's mean; e2e: its end)"
            if report_.get("burst") else "turn 2 of a conversation")
    lines = [f"bench prefix_cache: {report_['rounds']} round(s), {path} path, {what}; medians of "
             f"warm (prefix cache) / cold wall times; the same tokens on both: {report_['lossless']}",
             f"{'segment':<12} {'runs':>4} {'ttft warm/cold':>15} {'e2e warm/cold':>14} {'cached share':>13} "
             f"{'prompt tokens':>14}"]

    for seg, c in report_["table"].items():
        lines.append(f"{seg:<12} {c['runs']:>4} {ratio_text(c['ttft_warm_vs_cold']):>15} {ratio_text(c['e2e_warm_vs_cold']):>14} "
                     f"{ratio_text(c['cached_share']):>13} {ratio_text(c['prompt_tokens']):>14}")
    return "\n".join(lines)
