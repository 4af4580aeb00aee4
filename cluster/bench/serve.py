"""`specserve bench serve`: latency and throughput through the gRPC front door, per policy.

Owns: driving a running service (``--addr``) or a local one started from a Serve config with
fixed-spec (mode SPECULATIVE), fixed-plain (mode PLAIN) and routed (AUTO) policies at each
concurrency level over workload segments — policies side by side per level, so they see the same
machine state — and reporting per cell TTFT, TPOT, end-to-end p50/p99, tokens/s, α and the route
mix (table on stdout, JSON file). Streaming calls give TTFT (first chunk with tokens). First the
front-door overhead at concurrency 1: the same requests straight through an in-process
``AsyncEngine`` built from the same app config (the engine's own latency, tokenization included)
and through gRPC (proxy -> Router -> engine replica), interleaved request by request; the ratio of
medians per path (goal <= 1.10). ``--api openai`` adds the OpenAI-compatible HTTP front door
beside gRPC in every cell and in the overhead (``cluster.bench.serve_openai``). ``--quick`` is a
smoke run for a loaded 2-core machine. Each level takes fresh rows while the workload lasts, and
each policy (and each side of the front door's pairs) sends its requests in draft scopes of its own
(``bench-<run>/<policy>/<api>/c<pass>``, a new one each pass over a workload shorter than the run),
so a drafter that learns from traffic (suffix, portfolio) never drafts a request from an answer to
the same row; what a speculative request could still repeat, and which ratios that leaves
unjudged, is ``cluster.bench.repeats``. The pieces ``specserve map``'s sweep drives a service with
(``stream_one``, ``run_requests``, ``cell_stats``, the round plan, ``local_config``) are public.
Ignores: engine-internal timing (``bench spec``/``bench decode``), plots.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import secrets
import signal
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster.bench.repeats import SpecAnswers, format_repeats, level_start, scoped_rows
from cluster.common.prompt_rows import DEFAULT_SEGMENT, DEFAULT_WORKLOADS, read_prompt_rows

POLICIES = {"fixed_spec": 1, "fixed_plain": 2, "routed": 0}  # proto SpecMode per policy
PATH_NAMES = {1: "speculative", 2: "plain"}  # proto RoutePath
ROUTED_GOAL = 1.05  # routed p50 e2e <= 1.05 x the better fixed policy
FRONT_DOOR_GOAL = 1.10  # the front door adds <= 10% at concurrency 1
QUICK = {"levels": [1, 4, 16], "segments": 2, "requests": 4, "max_tokens": 16, "overhead_requests": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="output JSON file")
    p.add_argument("--addr", default=None, help="a running service; default: start one locally")
    p.add_argument("--app", default="specserve")
    p.add_argument("--config", type=Path, default=None,
                   help="Serve config of the local service (and of the in-process engine for the "
                        "front-door overhead); default deployments/serve_config.yaml")
    p.add_argument("--token", default=None)
    p.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    p.add_argument("--segments", default="code,summarize,chat", help="comma-separated workload names")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--requests", type=int, default=16, help="requests per cell (at least the concurrency)")
    p.add_argument("--rounds", type=int, default=0,
                   help="split each cell into rounds, policies interleaved in every order in turn; "
                        "0 (default) = one wave of `concurrency` requests per round, the finest "
                        "interleaving")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--overhead-requests", type=int, default=8,
                   help="request pairs (in-process vs gRPC) per path for the front-door overhead; 0 = skip")
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                   help="openai: every cell and the front-door overhead also through the OpenAI-compatible "
                        "HTTP API (the openai client), side by side with gRPC (cluster/bench/serve_openai.py)")
    p.add_argument("--http-url", default=None,
                   help="with --addr and --api openai: the service's OpenAI base URL, e.g. "
                        "http://127.0.0.1:8000/v1 (a local service: from its config)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: concurrency 1,4,16; first two segments; 4 requests per cell "
                        "(at least the concurrency); 16 tokens; 4 overhead pairs")


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` (nearest rank, 5 decimals); None for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))], 5)


def load_prompts(workloads: Path, segment: str, limit: int) -> list[dict]:
    path = workloads / f"{segment}.jsonl"
    if not path.is_file():
        from cluster.common.errors import UserFacingError

        raise UserFacingError(f"no workload {segment!r}: {path} not found")
    return read_prompt_rows(path, limit)


def _max_tokens(row: dict, cap: int) -> int:
    return min(cap, int(row.get("max_tokens", cap)))


# -- through the front door -------------------------------------------------------------------
def _request(pb2, row: dict, mode: int, max_tokens: int):
    """A GenerateRequest from a prompt row (``generate --prompts`` format): ``prompt`` (+ ``chat``)
    or ``messages``, and when present the constraint and sampling keys of ``specserve map`` rows."""
    req = pb2.GenerateRequest(max_tokens=_max_tokens(row, max_tokens), mode=mode,
                              segment=row.get("segment", ""), draft_scope=row.get("draft_scope", ""))
    if "messages" in row:
        for m in row["messages"]:
            req.messages.append(pb2.ChatMessage(role=m["role"], content=m["content"]))
    elif row.get("chat"):
        req.messages.append(pb2.ChatMessage(role="user", content=row["prompt"]))
    else:
        req.prompt = row["prompt"]
    for key in ("json_schema", "regex", "grammar", "temperature", "top_k"):
        if row.get(key):  # a workload's json_schema is an object; the request carries its JSON text
            value = row[key]
            setattr(req, key, json.dumps(value) if key == "json_schema" and not isinstance(value, str) else value)
    if row.get("top_p") is not None:
        req.top_p = float(row["top_p"])
    if row.get("seed") is not None:
        req.seed = int(row["seed"])
    req.stop.extend(row.get("stop") or ())
    return req


def unary_one(stub, pb2, md, row: dict, mode: int, max_tokens: int) -> dict:
    """One unary ``Generate`` (no TTFT: the client sees every token at the end)."""
    import grpc

    t0 = time.perf_counter()
    try:
        resp = stub.Generate(_request(pb2, row, mode, max_tokens), metadata=md, timeout=600)
    except grpc.RpcError as exc:
        return {"error": exc.code().name, "e2e": time.perf_counter() - t0, "ttft": None, "tokens": 0}
    return {"error": None, "e2e": time.perf_counter() - t0, "ttft": None, "tokens": len(resp.token_ids)}


def stream_one(stub, pb2, md, row: dict, mode: int, max_tokens: int) -> dict:
    """One ``GenerateStream`` of ``row`` in proto SpecMode ``mode``, timed: e2e, TTFT (first chunk
    with tokens), TPOT, tokens, the route and the speculation counters; a gRPC error is a result."""
    import grpc

    req = _request(pb2, row, mode, max_tokens)
    t0 = time.perf_counter()
    ttft = None
    ntok = 0
    last = None
    try:
        for ch in stub.GenerateStream(req, metadata=md, timeout=600):
            if ch.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            ntok += len(ch.token_ids)
            last = ch
    except grpc.RpcError as exc:  # counted per cell, never fatal: a full queue is a result too
        return {"error": exc.code().name, "e2e": time.perf_counter() - t0, "ttft": None, "tokens": 0,
                "tpot": None, "path": "error", "reason": exc.code().name, "drafted": 0, "accepted": 0}
    e2e = time.perf_counter() - t0
    return {"error": None, "e2e": e2e, "ttft": ttft, "tokens": ntok,
            "tpot": (e2e - ttft) / (ntok - 1) if ttft is not None and ntok > 1 else None,
            "path": PATH_NAMES.get(last.route.path, "?") if last else "?",
            "reason": last.route.reason if last else "", "drafted": last.spec.draft_tokens if last else 0,
            "accepted": last.spec.accepted_tokens if last else 0}


def wave_rows(rows: list[dict], offset: int, n: int, concurrency: int) -> list[dict]:
    """The rows of one wave: ``max(n, concurrency)`` from ``offset`` on, cycling."""
    return [rows[(offset + i) % len(rows)] for i in range(max(n, concurrency))]


def run_requests(stub, pb2, md, rows: list[dict], mode: int, concurrency: int, n: int,
                 max_tokens: int, offset: int = 0, one=None) -> tuple[list[dict], float]:
    """n requests (rows from ``offset`` on, cycling: ``wave_rows``) with ``concurrency`` in flight
    -> (results in row order, wall); ``one(row, mode, max_tokens)`` sends one (default: a gRPC
    stream)."""
    jobs = wave_rows(rows, offset, n, concurrency)
    one = one or (lambda row, m, k: stream_one(stub, pb2, md, row, m, k))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: one(r, mode, max_tokens), jobs))
    return results, time.perf_counter() - t0


def cell_stats(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    e2e = [r["e2e"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    drafted = sum(r["drafted"] for r in ok)
    return {"requests": len(results), "errors": dict(Counter(r["error"] for r in results if r["error"])),
            "wall_s": round(wall, 4), "tokens": sum(r["tokens"] for r in ok),
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
            "e2e_p50": percentile(e2e, 0.5), "e2e_p99": percentile(e2e, 0.99),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
            "draft_tokens": drafted,
            "acceptance_rate": round(sum(r["accepted"] for r in ok) / drafted, 4) if drafted else None,
            "route_mix": dict(Counter(f"{r['path']}:{r['reason']}" for r in results)),
            "e2e_s": [round(x, 5) for x in e2e]}  # per request in row order (summarize pairs them)


# -- front-door overhead: in-process AsyncEngine vs gRPC, concurrency 1 ------------------------
def _direct_one(loop, engine, row: dict, mode, max_tokens: int, rid: str) -> dict:
    from cluster.common.request import GenerationRequest, SamplingParams

    async def go() -> dict:
        t0 = time.perf_counter()
        if row.get("chat"):  # tokenization counted: the service's engine replica does it too
            ids = engine.apply_chat_template([{"role": "user", "content": row["prompt"]}])
        else:
            ids = engine.tokenize(row["prompt"])
        req = GenerationRequest(rid, ids, SamplingParams(max_tokens=_max_tokens(row, max_tokens)),
                                segment=row.get("segment", DEFAULT_SEGMENT), mode=mode,
                                draft_scope=row.get("draft_scope", ""))
        ttft, ntok = None, 0
        async for out in engine.generate(req):
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            ntok += len(out.new_token_ids)
        return {"e2e": time.perf_counter() - t0, "ttft": ttft, "tokens": ntok}

    return loop.run_until_complete(go())


def run_scope(prefix: str = "bench") -> str:
    """This run's draft-scope prefix: no earlier run's answers (nor live traffic's) are drafted from."""
    return f"{prefix}-{secrets.token_hex(4)}"


def front_door_overhead(stub, pb2, md, app_args: dict, rows: list[dict], max_tokens: int,
                        pairs: int, door=None, answers: SpecAnswers | None = None, scope: str = "") -> dict:
    """Per path (speculative / plain): the same requests through an engine stepping in this
    process — ``AsyncEngine`` with the engine config the service's replicas build (the configured
    ``engine_impl`` itself when it is not an ``AsyncEngine``, e.g. FakeEngine) — and through gRPC,
    as ``GenerateStream`` (key ``<path>``) and as unary ``Generate`` (key ``<path>/unary``), the
    three in ``round_order``, after one warm-up round. With ``door`` (an ``OpenAIDoor``) a fourth
    side, the OpenAI HTTP stream (key ``<path>/openai``). With placement ``separate`` the in-process
    spec engine drafts locally (no DraftServer in this process). ``answers`` records the
    service's speculative requests (``repeated_rows`` in the result). Each side sends in a draft
    scope of its own (``<scope>/door/<side>``; the in-process engine is a new one per path): the
    service's second call of a pair never drafts from the first's answer."""
    from cluster.common.request import SpecMode
    from cluster.engine.async_engine import AsyncEngine
    from deployments.app_config import AppConfig

    app = AppConfig(**app_args)
    engine_cls, engine_opts = app.engine_impl.load(), app.engine_impl.options
    if issubclass(engine_cls, AsyncEngine):  # ProcessEngine too: its core-process hop counts as
        engine_cls, engine_opts = AsyncEngine, {}  # front door; the engine steps right here
    paths = ([("speculative", True, 1, SpecMode.SPECULATIVE)] if app.speculative else []) + \
        [("plain", False, 2, SpecMode.PLAIN)]
    out: dict = {"concurrency": 1, "pairs": pairs, "goal_ratio": FRONT_DOOR_GOAL,
                 "engine": f"{engine_cls.__module__}:{engine_cls.__name__}",
                 "service_engine": app.engine_impl.cls, "placement": app.placement.value, "paths": {},
                 "repeated_rows": 0}
    loop = asyncio.new_event_loop()
    try:
        for name, speculative, proto_mode, mode in paths:
            engine = engine_cls(app.engine_config(speculative), **engine_opts)
            loop.run_until_complete(engine.start())  # loads the model here, in the bench process
            try:
                got: dict[str, list[dict]] = {"direct": [], "stream": [], "unary": []}
                calls = {
                    "direct": lambda row, i: _direct_one(loop, engine, row, mode, max_tokens, f"fd-{name}-{i}"),
                    "stream": lambda row, i: stream_one(stub, pb2, md, row, proto_mode, max_tokens),
                    "unary": lambda row, i: unary_one(stub, pb2, md, row, proto_mode, max_tokens)}
                if door is not None:
                    got["openai"] = []
                    calls["openai"] = lambda row, i: door.one(row, proto_mode, max_tokens)
                for i in range(pairs + 1):  # round 0 warms all three up and is not counted
                    row = {side: dict(rows[i % len(rows)], draft_scope=f"{scope}/door/{side}") if scope
                           else rows[i % len(rows)] for side in calls}
                    res = {side: calls[side](row[side], i) for side in round_order(list(calls), i)}
                    if answers is not None and speculative:
                        for side, r in res.items():  # in the order they ran
                            if side != "direct":
                                out["repeated_rows"] += answers.wave([row[side]], [r], forced_speculative=True)
                    if i and all(r.get("error") is None for r in res.values()):
                        for side, r in res.items():
                            got[side].append(r)
                for rpc, key in (("stream", name), ("unary", f"{name}/unary"), ("openai", f"{name}/openai")):
                    if rpc not in got:
                        continue
                    out["paths"][key] = _overhead_summary(got["direct"], got[rpc])
                    if rpc == "openai":  # its own names, and the pairs against the gRPC stream
                        out["paths"][key] = {k.replace("grpc_", "openai_"): v for k, v in out["paths"][key].items()}
                        out["paths"][key]["over_grpc_stream_paired"] = _median_ratio(got["openai"], got["stream"])
                    print(f"front door {key:>18}: {'openai' if rpc == 'openai' else 'grpc'}/direct e2e, "
                          f"median of pair ratios = "
                          f"{out['paths'][key]['e2e_ratio_paired']} (ratio of medians "
                          f"{out['paths'][key]['e2e_ratio']})", file=sys.stderr, flush=True)
            finally:
                loop.run_until_complete(engine.shutdown())
                engine = None  # the engine's last reference (the lambdas above close over this name)
                gc.collect()
    finally:
        loop.close()
    # the goal is judged per pair (same prompt, back to back): prompts differ in length and, on
    # the speculative path, in acceptance, so medians of the two sides can be different prompts
    ratios = [p["e2e_ratio_paired"] for p in out["paths"].values() if p["e2e_ratio_paired"] is not None]
    out["worst_e2e_ratio"] = max(ratios) if ratios else None
    out["meets_goal"] = bool(ratios) and max(ratios) <= FRONT_DOOR_GOAL
    return out


def _median_ratio(a: list[dict], b: list[dict]) -> float | None:
    """Median over pairs of a's e2e / b's e2e."""
    return round(statistics.median(x["e2e"] / y["e2e"] for x, y in zip(a, b)), 4) if a and len(a) == len(b) else None


def _overhead_summary(direct: list[dict], grpc_: list[dict]) -> dict:
    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 5) if xs else None

    d_e2e, g_e2e = med([r["e2e"] for r in direct]), med([r["e2e"] for r in grpc_])
    d_ttft, g_ttft = med([r["ttft"] for r in direct]), med([r["ttft"] for r in grpc_])
    return {"requests": len(direct),
            "direct_e2e_p50": d_e2e, "grpc_e2e_p50": g_e2e,
            "e2e_ratio": round(g_e2e / d_e2e, 4) if d_e2e and g_e2e else None,
            "e2e_ratio_paired": med([g["e2e"] / d["e2e"] for d, g in zip(direct, grpc_)]),
            "pairs_e2e_s": [[round(d["e2e"], 5), round(g["e2e"], 5)] for d, g in zip(direct, grpc_)],
            "e2e_added_ms_p50": round(1000 * med([g["e2e"] - d["e2e"] for d, g in zip(direct, grpc_)]), 2)
            if direct else None,
            "direct_ttft_p50": d_ttft, "grpc_ttft_p50": g_ttft,
            "ttft_ratio": round(g_ttft / d_ttft, 4) if d_ttft and g_ttft else None,
            "same_token_counts": [d["tokens"] for d in direct] == [g["tokens"] for g in grpc_]}


# -- the run ----------------------------------------------------------------------------------
def _plan(args) -> dict:
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; choose from {list(POLICIES)}")
    segments = [s for s in args.segments.split(",") if s]
    apis = ["grpc", "openai"] if args.api == "openai" else ["grpc"]
    if args.quick:
        return {"levels": QUICK["levels"], "segments": segments[: QUICK["segments"]], "policies": policies,
                "apis": apis,
                "requests": QUICK["requests"], "max_tokens": QUICK["max_tokens"], "rounds": 1,
                "overhead_requests": min(args.overhead_requests, QUICK["overhead_requests"])}
    return {"levels": [int(x) for x in args.concurrency.split(",") if x], "segments": segments,
            "policies": policies, "apis": apis, "requests": args.requests, "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "overhead_requests": args.overhead_requests}


WARM_UP_ROW = {"prompt": "Hello", "segment": "warm-up"}


def round_plan(requests: int, concurrency: int, rounds: int) -> tuple[int, int]:
    """(rounds, requests per round) for a cell: at least ``concurrency`` requests per round, at
    least ``max(requests, concurrency)`` in all; ``rounds`` 0 = one wave per round."""
    total = max(requests, concurrency)
    if rounds <= 0:
        return -(-total // concurrency), concurrency
    per = max(concurrency, -(-total // rounds))
    return -(-total // per), per


def rows_sent(requests: int, levels: list[int], rounds: int) -> int:
    """Rows one policy sends over all ``levels`` of one segment (``round_plan`` per level)."""
    return sum(level_start(0, *round_plan(requests, c, rounds)) for c in levels)


def round_order(items: list[str], r: int) -> list[str]:
    """The order of what runs side by side (policies, front-door sides) in round r: the
    permutations in turn, so that over a cycle each runs in every position and right after every
    other equally often (a policy that follows one using the other engine starts on a cold engine:
    a plain rotation gave routed that place twice as often as fixed-spec)."""
    import itertools

    orders = list(itertools.permutations(items))
    return list(orders[r % len(orders)])


def _bench(args, addr: str, app: str, app_args: dict, http_url: str | None = None) -> dict:
    import grpc

    from cluster.api import stubs
    from cluster.api.server_fields import check_request_fields

    pb2 = stubs.generation_pb2()
    md = [("application", app)] + ([("authorization", f"Bearer {args.token}")] if args.token else [])
    plan = _plan(args)
    door = None
    if plan["apis"] != ["grpc"]:
        from cluster.bench.serve_openai import OpenAIDoor

        door = OpenAIDoor(http_url, args.token)
    cells = []
    t_start = time.perf_counter()
    with grpc.insecure_channel(addr) as channel:
        stub = stubs.generation_grpc().GenerationStub(channel)
        # every request is sent in a draft scope: a server that would ignore the field (older than
        # it) would let the policies draft from each other's answers, so it is not benchmarked
        check_request_fields(pb2.GenerateRequest(prompt="x", segment="s", draft_scope=f"{run_scope()}/check"),
                             stub.ModelInfo(pb2.ModelInfoRequest(), metadata=md, timeout=30))
        seg_rows = {s: load_prompts(args.workloads, s, limit=None) for s in plan["segments"]}
        answers = SpecAnswers()
        scope = run_scope()
        start = dict.fromkeys(seg_rows, 0)  # where each segment's next level takes its rows
        overhead = None
        if plan["overhead_requests"] > 0 and app_args is not None:
            # first, while the service's engines are as fresh as the in-process one: adaptive K
            # learns per segment, and an engine that has served the whole sweep drafts differently
            # from a new one, which would be measured as front-door cost
            rows = [r for rs in seg_rows.values() for r in rs]
            overhead = front_door_overhead(stub, pb2, md, app_args, rows, plan["max_tokens"],
                                           plan["overhead_requests"], door, answers, scope)
            sent = {id(r) for r in rows[: plan["overhead_requests"] + 1]}  # the levels start after those
            start = {s: sum(id(r) in sent for r in rs) for s, rs in seg_rows.items()}
        for segment, all_rows in seg_rows.items():
            # each policy and front door in draft scopes of its own (a new one each pass over the
            # workload): routed and fixed-spec answer the same rows, and neither drafts from the
            # other's answers, nor from its own earlier answer to a row sent again
            needed = start[segment] + rows_sent(plan["requests"], plan["levels"], plan["rounds"])
            by_policy = {(p, api): scoped_rows(all_rows, f"{scope}/{p}/{api}", needed)
                         for p in plan["policies"] for api in plan["apis"]}
            for c in plan["levels"]:
                # side by side per level, in rounds with the policy order rotating, so that a slow
                # stretch of a noisy machine hits every policy alike; every policy gets the same rows
                # (each level fresh ones where the workload has enough: SpecAnswers)
                per = {(p, api): ([], 0.0, 0) for p in plan["policies"] for api in plan["apis"]}
                rounds, n_round = round_plan(plan["requests"], c, plan["rounds"])
                for r in range(rounds):
                    for policy in round_order(plan["policies"], r):
                        for api in round_order(plan["apis"], r):
                            # one short untimed request first: the engine this policy uses may have
                            # sat idle (its weights out of cache) while another policy ran on the other
                            stream_one(stub, pb2, md, WARM_UP_ROW, POLICIES[policy], 1)
                            one = (lambda row, mode, n: door.one(row, mode, n)) if api == "openai" else None
                            offset = start[segment] + r * n_round
                            rows = by_policy[policy, api]
                            res, wall = run_requests(stub, pb2, md, rows, POLICIES[policy], c, n_round,
                                                     plan["max_tokens"], offset=offset, one=one)
                            repeated = answers.wave(wave_rows(rows, offset, n_round, c), res,
                                                    forced_speculative=policy == "fixed_spec")
                            got = per[policy, api]
                            per[policy, api] = (got[0] + res, got[1] + wall, got[2] + repeated)
                start[segment] = level_start(start[segment], rounds, n_round)
                measured = router_latency(stub, pb2, md, segment)
                for (policy, api), (res, wall, repeated) in per.items():
                    cell = cell_stats(res, wall)
                    cell.update(segment=segment, concurrency=c, policy=policy, api=api, repeated_rows=repeated)
                    if policy == "routed":
                        cell["router_latency"] = measured
                    cells.append(cell)
                    print(f"{segment:>12} c={c:<3} {policy:<11} {api:<6} e2e_p50={cell['e2e_p50']}s "
                          f"tok/s={cell['tokens_per_s']:.1f} mix={cell['route_mix']}",
                          file=sys.stderr, flush=True)
    repeats = answers.summary(None if app_args is None else service_drafter(app_args))
    if overhead and overhead["repeated_rows"] and repeats["drafter_learns_from_traffic"]:
        overhead["meets_goal"] = None  # the second gRPC call of a pair drafted from the first's answer
    return {"addr": addr, "app": app, "quick": bool(args.quick), "plan": plan,
            "elapsed_s": round(time.perf_counter() - t_start, 1), "app_args": app_args,
            "cells": cells, "repeated_rows": repeats,
            "summary": summarize([c for c in cells if c["api"] == "grpc"], repeats["drafter_learns_from_traffic"]),
            "front_door": overhead, **_api_report(cells, plan, door)}


def service_drafter(app_args: dict) -> str:
    """The drafter a service with these app args runs (the app config's default when unset)."""
    from deployments.app_config import AppConfig

    return AppConfig(**app_args).drafter


def _api_report(cells: list[dict], plan: dict, door) -> dict:
    """With ``--api openai``: the OpenAI door's base URL and its overhead over gRPC per cell."""
    if door is None:
        return {}
    from cluster.bench.serve_openai import api_overhead

    return {"http_url": door.base_url, "api_overhead": api_overhead(cells)}


def router_latency(stub, pb2, md, segment: str) -> dict[str, dict]:
    """What the Router measured for ``segment`` so far (ModelInfo ``path_latency``): path ->
    samples, service seconds per token ≈ base + per_running x requests running, capacity. Empty if
    it reports none."""
    info = stub.ModelInfo(pb2.ModelInfoRequest(), metadata=md, timeout=30)
    names = {pb2.PATH_SPECULATIVE: "speculative", pb2.PATH_PLAIN: "plain"}
    return {names.get(pl.path, str(pl.path)): {"samples": pl.samples, "base_s": round(pl.base_s, 5),
                                                 "per_running_s": round(pl.per_running_s, 5),
                                                 "capacity": pl.capacity}
            for pl in info.path_latency if pl.segment == segment}


def ratio_interval(routed: list[float], fixed: list[list[float]], resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float] | None:
    """90% bootstrap interval of p50(routed) / min over the fixed policies of p50(fixed): each
    policy's per-request e2e resampled with replacement (fixed seed: reproducible). How far a
    cell's ratio moves from request sampling alone — on a noisy machine, the noise floor."""
    import random

    fixed = [f for f in fixed if f]
    if not routed or not fixed:
        return None
    rng = random.Random(seed)
    med = statistics.median
    return _interval90([med(rng.choices(routed, k=len(routed))) / min(med(rng.choices(f, k=len(f))) for f in fixed)
                        for _ in range(resamples)])


def _interval90(draws: list[float]) -> tuple[float, float]:
    """The 5th and 95th percentiles of bootstrap draws."""
    draws = sorted(draws)
    return round(draws[int(0.05 * (len(draws) - 1))], 4), round(draws[int(0.95 * (len(draws) - 1))], 4)


def paired_ratio(routed: list[float], fixed: list[float], resamples: int = 2000,
                 seed: int = 0) -> tuple[float, list[float]] | None:
    """Median over rows of routed e2e / fixed e2e — the two lists in row order (the same prompt in
    the same round, back to back), so prompt length and a slow stretch of the machine cancel —
    and its 90% bootstrap interval. None unless the lists pair up."""
    import random

    if not routed or len(routed) != len(fixed):
        return None
    ratios = [r / f for r, f in zip(routed, fixed)]
    rng = random.Random(seed)
    ci = _interval90([statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)])
    return round(statistics.median(ratios), 4), list(ci)


def summarize(cells: list[dict], learns: bool | None = None) -> list[dict]:
    """Per (segment, concurrency): routed p50 e2e over the better fixed policy (goal <= 1.05),
    with its 90% bootstrap interval over requests (``ci90``), and beside it the paired estimate
    (``paired_ratio``, ``paired_ci90``: per-row ratios, same prompt and round). Where either cell
    repeated rows (``repeated_rows``: routed and fixed-spec answer the same rows) and the service's
    drafter learns from traffic (``learns``), the one that ran second drafted from the other's
    answer: ``meets_goal`` is None (not judged)."""
    out = []
    keys = sorted({(c["segment"], c["concurrency"]) for c in cells})
    for seg, conc in keys:
        by = {c["policy"]: c for c in cells if c["segment"] == seg and c["concurrency"] == conc}
        fixed = {p: by[p]["e2e_p50"] for p in ("fixed_spec", "fixed_plain") if p in by and by[p]["e2e_p50"]}
        if "routed" in by and by["routed"]["e2e_p50"] and fixed:
            best = min(fixed, key=fixed.get)
            ratio = round(by["routed"]["e2e_p50"] / fixed[best], 4)
            ci = ratio_interval(by["routed"].get("e2e_s") or [],
                                [by[p].get("e2e_s") or [] for p in fixed])
            aligned = not by["routed"].get("errors") and not by[best].get("errors")
            paired = paired_ratio(by["routed"].get("e2e_s") or [], by[best].get("e2e_s") or []) \
                if aligned else None
            row = {"segment": seg, "concurrency": conc, "best_fixed": best,
                   "routed_over_best_fixed": ratio, "meets_goal": ratio <= ROUTED_GOAL,
                   "ci90": list(ci) if ci else None,
                   "paired_ratio": paired[0] if paired else None,
                   "paired_ci90": paired[1] if paired else None}
            repeated = {p: by[p].get("repeated_rows", 0) for p in ("routed", best)}
            if any(repeated.values()):
                row["repeated_rows"] = repeated
                if learns:
                    row["meets_goal"] = None
            out.append(row)
    return out


def _f(x, scale: float = 1.0, nd: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}"


def format_report(report: dict) -> str:
    head = (f"{'segment':<12} {'conc':>4} {'policy':<11} {'n':>3} {'err':>3} {'ttft50':>7} {'tpot50':>7} "
            f"{'e2e50':>7} {'e2e99':>7} {'tok/s':>7} {'alpha':>5}  route mix")
    lines = ["latencies in ms", head, "-" * len(head)]
    for c in report["cells"]:
        mix = ", ".join(f"{k}={v}" for k, v in sorted(c["route_mix"].items()))
        policy = c["policy"] + ("/oai" if c.get("api") == "openai" else "")
        lines.append(f"{c['segment']:<12} {c['concurrency']:>4} {policy:<11} {c['requests']:>3} "
                     f"{sum(c['errors'].values()):>3} {_f(c['ttft_p50'], 1e3):>7} {_f(c['tpot_p50'], 1e3):>7} "
                     f"{_f(c['e2e_p50'], 1e3):>7} {_f(c['e2e_p99'], 1e3):>7} {_f(c['tokens_per_s']):>7} "
                     f"{_f(c['acceptance_rate'], 1, 2):>5}  {mix}")
        if c.get("router_latency"):
            fits = "; ".join(f"{path} {f['base_s'] * 1e3:.1f} + {f['per_running_s'] * 1e3:.2f}·b "
                             f"(cap {f['capacity']}, {f['samples']} requests)"
                             for path, f in sorted(c["router_latency"].items()))
            lines.append(f"{'':<17} router's service ms/token at b running: {fits}")
    if report["summary"]:
        lines += ["", f"routed p50 e2e / better fixed policy (goal <= {ROUTED_GOAL}):"]
        lines += [f"  {s['segment']:<12} c={s['concurrency']:<3} {s['routed_over_best_fixed']:.3f} "
                  + (f"[90% {s['ci90'][0]:.2f}-{s['ci90'][1]:.2f}] " if s.get("ci90") else "")
                  + (f"paired {s['paired_ratio']:.3f} [{s['paired_ci90'][0]:.2f}-{s['paired_ci90'][1]:.2f}] "
                     if s.get("paired_ratio") else "")
                  + f"(best fixed: {s['best_fixed']})"
                  + {True: "", False: "  MISSES GOAL",
                     None: "  NOT JUDGED (repeated rows drafted from memory)"}[s["meets_goal"]]
                  for s in report["summary"]]
    lines += format_repeats(report.get("repeated_rows"))
    fd = report.get("front_door")
    if fd:
        lines += ["", f"front-door overhead at concurrency 1, {fd['pairs']} request pairs "
                      f"(gRPC / in-process AsyncEngine, goal <= {FRONT_DOOR_GOAL}; "
                      "<path>: GenerateStream, <path>/unary: Generate, <path>/openai: the OpenAI "
                      "HTTP stream over the same in-process side):"]
        if fd.get("meets_goal") is None and fd.get("repeated_rows"):
            lines.append(f"  NOT JUDGED: {fd['repeated_rows']} speculative gRPC calls repeated their pair's row "
                         "(a drafter that learns from traffic drafted them from memory)")
        for name, p in fd["paths"].items():
            door = "openai" if "openai_e2e_p50" in p else "grpc"
            lines.append(f"  {name:<17} e2e p50 {_f(p['direct_e2e_p50'], 1e3)} -> {_f(p[door + '_e2e_p50'], 1e3)} ms "
                         f"(ratio {p['e2e_ratio']}; per pair: ratio {p['e2e_ratio_paired']}, "
                         f"+{p['e2e_added_ms_p50']} ms); ttft p50 "
                         f"{_f(p['direct_ttft_p50'], 1e3)} -> {_f(p[door + '_ttft_p50'], 1e3)} ms (ratio {p['ttft_ratio']})"
                         + (f"; OpenAI / gRPC stream per pair {p['over_grpc_stream_paired']}"
                            if door == "openai" else ""))
    if report.get("api_overhead") is not None:
        from cluster.bench.serve_openai import format_api_overhead

        lines += format_api_overhead(report["api_overhead"])
    return "\n".join(lines)


def local_config(config: Path | None, addr: str | None = None) -> dict:
    """The Serve config (``config``, else the shipped one); without ``addr`` (a running service) it is
    for a local service, which gets free loopback ports (others may run one too)."""
    from deployments.local import DEFAULT_CONFIG, free_port, load_config

    ns = argparse.Namespace(config=config or DEFAULT_CONFIG, model=None, drafter=None,
                            placement=None, port=None if addr else free_port())
    cfg = load_config(ns)
    if not addr:
        cfg["http_options"] = {**(cfg.get("http_options") or {}), "host": "127.0.0.1", "port": free_port()}
    return cfg


def raise_interrupt(signum, _frame) -> None:
    """A signal handler: SIGTERM (``timeout``, a CI runner) unwinds like Ctrl-C."""
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    from deployments.local import http_base_url

    if args.http_url and args.api != "openai":
        print("--http-url is for --api openai", file=sys.stderr)
        return 2
    if args.addr and args.api == "openai" and not args.http_url:
        print("--api openai with --addr needs --http-url (the service's OpenAI base URL)", file=sys.stderr)
        return 2
    cfg = local_config(args.config, args.addr)
    app_args = cfg["applications"][0].get("args", {})
    if args.addr:
        if args.config is None:  # a running service: its config is unknown unless given
            print("front-door overhead skipped: pass --config with the service's Serve config",
                  file=sys.stderr)
            app_args = None
        from cluster.api.server_fields import UnsupportedField

        try:
            report = _bench(args, args.addr, args.app, app_args, args.http_url)
        except UnsupportedField as exc:
            print(f"bench serve: {exc}", file=sys.stderr)
            return 2
    else:
        from deployments.local import local_service

        # SIGTERM (e.g. `timeout`, a CI runner) unwinds like Ctrl-C, so the local Ray is shut down
        # instead of leaving its agents behind
        signal.signal(signal.SIGTERM, raise_interrupt)
        with local_service(cfg) as (addr, app):
            report = _bench(args, addr, app, app_args, http_base_url(cfg))
    print(format_report(report), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0
