"""`specserve bench serve`: latency and throughput through the gRPC front door, per policy.

Owns: driving a running service (``--addr``) or a local one started from a Serve config with
fixed-spec (mode SPECULATIVE), fixed-plain (mode PLAIN) and routed (AUTO) policies at each
concurrency level over workload segments, and reporting per cell TTFT, TPOT, end-to-end p50/p99,
tokens/s, α and the route mix, as JSON. Streaming calls give TTFT (first chunk with tokens).
Bounded: ``--requests`` per cell (at least the concurrency), ``--quick`` for a smoke run.
Ignores: engine-internal timing (``bench spec``/``bench decode``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

POLICIES = {"fixed_spec": 1, "fixed_plain": 2, "routed": 0}
DEFAULT_WORKLOADS = Path(__file__).resolve().parents[3] / "shared" / "workloads"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="output JSON file")
    p.add_argument("--addr", default=None, help="a running service; default: start one locally")
    p.add_argument("--app", default="specserve")
    p.add_argument("--config", type=Path, default=None, help="Serve config for the local service")
    p.add_argument("--token", default=None)
    p.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    p.add_argument("--segments", default="code,summarize,chat", help="comma-separated workload names")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--requests", type=int, default=16, help="requests per cell (>= concurrency)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="concurrency 1,4; one segment; 4 requests; 16 tokens")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def load_prompts(workloads: Path, segment: str, limit: int) -> list[dict]:
    rows = []
    with open(workloads / f"{segment}.jsonl") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) >= limit:
                break
    return rows


def _one(stub, pb2, md, row: dict, mode: int, max_tokens: int) -> dict:
    req = pb2.GenerateRequest(max_tokens=min(max_tokens, int(row.get("max_tokens", max_tokens))),
                              mode=mode, segment=row.get("segment", ""))
    if row.get("chat"):
        req.messages.append(pb2.ChatMessage(role="user", content=row["prompt"]))
    else:
        req.prompt = row["prompt"]
    t0 = time.perf_counter()
    ttft = None
    ntok = 0
    last = None
    for ch in stub.GenerateStream(req, metadata=md, timeout=600):
        if ch.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        ntok += len(ch.token_ids)
        last = ch
    e2e = time.perf_counter() - t0
    return {"e2e": e2e, "ttft": ttft, "tokens": ntok,
            "tpot": (e2e - ttft) / (ntok - 1) if ttft is not None and ntok > 1 else None,
            "path": {1: "speculative", 2: "plain"}.get(last.route.path, "?") if last else "?",
            "reason": last.route.reason if last else "", "drafted": last.spec.draft_tokens if last else 0,
            "accepted": last.spec.accepted_tokens if last else 0}


def run_cell(stub, pb2, md, rows: list[dict], mode: int, concurrency: int, n: int, max_tokens: int) -> dict:
    jobs = [rows[i % len(rows)] for i in range(max(n, concurrency))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: _one(stub, pb2, md, r, mode, max_tokens), jobs))
    wall = time.perf_counter() - t0
    e2e = [r["e2e"] for r in results]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    drafted = sum(r["drafted"] for r in results)
    return {"requests": len(results), "wall_s": round(wall, 4),
            "tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 2),
            "e2e_p50": _pct(e2e, 0.5), "e2e_p99": _pct(e2e, 0.99),
            "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
            "tpot_p50": _pct(tpot, 0.5), "tpot_p99": _pct(tpot, 0.99),
            "acceptance_rate": round(sum(r["accepted"] for r in results) / drafted, 4) if drafted else None,
            "route_mix": dict(Counter(f"{r['path']}:{r['reason']}" for r in results))}


def _bench(args, addr: str, app: str) -> dict:
    import grpc

    from cluster.api import stubs

    pb2 = stubs.generation_pb2()
    md = [("application", app)] + ([("authorization", f"Bearer {args.token}")] if args.token else [])
    levels = [1, 4] if args.quick else [int(x) for x in args.concurrency.split(",")]
    segments = args.segments.split(",")[:1] if args.quick else args.segments.split(",")
    n_req = 4 if args.quick else args.requests
    max_tokens = 16 if args.quick else args.max_tokens
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; choose from {list(POLICIES)}")
    cells = []
    with grpc.insecure_channel(addr) as channel:
        stub = stubs.generation_grpc().GenerationStub(channel)
        for segment in segments:
            rows = load_prompts(args.workloads, segment, limit=max(levels) * 2)
            for c in levels:
                for policy in policies:  # side by side per level: same machine state
                    cell = run_cell(stub, pb2, md, rows, POLICIES[policy], c, max(n_req, c), max_tokens)
                    cell.update(segment=segment, concurrency=c, policy=policy)
                    cells.append(cell)
                    print(f"{segment:>12} c={c:<3} {policy:<11} e2e_p50={cell['e2e_p50']:.3f}s "
                          f"tok/s={cell['tokens_per_s']:.1f} mix={cell['route_mix']}", file=sys.stderr)
    return {"addr": addr, "app": app, "max_tokens": max_tokens, "cells": cells,
            "summary": summarize(cells)}


def summarize(cells: list[dict]) -> list[dict]:
    """Per (segment, concurrency): routed p50 e2e over the better fixed policy (goal <= 1.05)."""
    out = []
    keys = sorted({(c["segment"], c["concurrency"]) for c in cells})
    for seg, conc in keys:
        by = {c["policy"]: c for c in cells if c["segment"] == seg and c["concurrency"] == conc}
        fixed = [by[p]["e2e_p50"] for p in ("fixed_spec", "fixed_plain") if p in by]
        if "routed" in by and fixed:
            out.append({"segment": seg, "concurrency": conc,
                        "routed_over_best_fixed": round(by["routed"]["e2e_p50"] / min(fixed), 4)})
    return out


def run(args: argparse.Namespace) -> int:
    if args.addr:
        report = _bench(args, args.addr, args.app)
    else:
        from cluster.commands.serve import DEFAULT_CONFIG, load_config, local_service

        ns = argparse.Namespace(config=args.config or DEFAULT_CONFIG, port=None, model=None,
                                drafter=None, placement=None)
        cfg = load_config(ns)
        with local_service(cfg) as (addr, app):
            report = _bench(args, addr, app)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0
