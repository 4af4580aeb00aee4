"""`specserve bench cancel`: how many gRPC stream cancellations reach the engine.

Owns: a local Serve app on the fake engine (no model: what is measured is the cancellation's path,
Client -> Serve's gRPC proxy -> Router -> engine, not decoding), streams the engine holds after
their first chunk (``HOLD_MARKER``: nothing but a cancellation frees them before ``--hold-s``),
opened back to back, each cancelled ``settle`` seconds after its first chunk arrived, several
settles interleaved round by round (side by side on one machine state), on the speculative and
the plain engine in turn. After each burst: were all freed (the engine running nothing, its KV
pool full, within ``--free-timeout-s``), and the ones lost, attributed by the Router's in-flight
count (still counted: the cancellation never reached the Router — Ray Serve's gRPC proxy; not
counted: lost between the Router and the engine). Lost ones are waited out (the hold ends) before
the next burst, so each starts clean.
Prints the counts and writes JSON. Ignores: unary calls (their proxy waits on the whole answer)
and HTTP.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_JSON = Path("bench_cancel.json")
APP = "cancel"
PATHS = {"speculative": ("SpecEngine", 1), "plain": ("BatchEngine", 2)}  # mode 1/2 forces the path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=50,
                   help="rounds; each cancels --streams streams per settle and path (default 50)")
    p.add_argument("--streams", type=int, default=4,
                   help="streams opened and cancelled back to back in a round, per settle and path (default 4)")
    p.add_argument("--settle", default="0,0.3",
                   help="comma-separated seconds between a stream's first chunk and its cancellation "
                        "(default 0,0.3)")
    p.add_argument("--hold-s", type=float, default=8.0,
                   help="a held stream the cancellation missed ends by itself after this long (default 8)")
    p.add_argument("--free-timeout-s", type=float, default=3.0,
                   help="a cancellation that has not freed the engine's KV by then counts as lost (default 3)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})")


def service_config(hold_s: float) -> dict:
    """A Serve config for ``local_service``: the fake engine on both paths, 0.1 CPU each."""
    from deployments.local import free_port

    small = {"num_replicas": 1, "num_cpus": 0.1, "num_gpus": 0}
    args = {"model": "fake", "drafter": "ngram", "num_draft_tokens": 4, "torch_threads": 1,
            "router_deployment": small, "spec_engine": {**small, "max_num_seqs": 4},
            "batch_engine": {**small, "max_num_seqs": 4},
            "engine_impl": {"cls": "cluster.engine.fake_engine:FakeEngine",
                            "options": {"token_delay_s": 0.02, "hold_limit_s": hold_s}}}
    return {"applications": [{"name": APP, "route_prefix": f"/{APP}", "args": args}],
            "grpc_options": {"port": free_port()},
            "http_options": {"host": "127.0.0.1", "port": free_port()}}


def _engine_running(deployment: str) -> int:
    """Requests the engine holds; one that holds none has its whole KV pool free."""
    from ray import serve

    s = serve.get_deployment_handle(deployment, app_name=APP).stats.remote().result(timeout_s=10)
    if s["num_running"] == 0 and s["kv_blocks_free"] != s["kv_blocks_total"]:
        raise RuntimeError(f"the {deployment} runs nothing but holds KV blocks: {s}")
    return s["num_running"]


def _wait(pred, timeout_s: float) -> float | None:
    """Seconds until ``pred()`` held, or None if it did not within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def cancel_burst(stub, pb2, md, path: str, n: int, settle_s: float, free_timeout_s: float,
                 hold_s: float) -> dict:
    """Hold ``n`` streams on ``path`` one after another, each cancelled ``settle_s`` after its first
    chunk and the next opened at once (the proxy busy with one stream when another's cancellation
    arrives, as under load); then what became of them."""
    from cluster.engine.fake_engine import HOLD_MARKER

    deployment, mode = PATHS[path]
    for _ in range(n):
        it = stub.GenerateStream(pb2.GenerateRequest(prompt="cancel " + HOLD_MARKER, max_tokens=250, mode=mode),
                                 metadata=md, timeout=hold_s + 60)
        next(it)
        time.sleep(settle_s)
        it.cancel()
    freed_s = _wait(lambda: _engine_running(deployment) == 0, free_timeout_s)
    if freed_s is not None:
        return {"cancelled": n, "lost": 0, "lost_before_router": 0, "freed_s": freed_s}
    lost = _engine_running(deployment)
    info = stub.ModelInfo(pb2.ModelInfoRequest(), metadata=md, timeout=10)
    router_held = info.spec_in_flight if path == "speculative" else info.plain_in_flight
    if _wait(lambda: _engine_running(deployment) == 0, hold_s + 30) is None:  # the hold ends them
        raise RuntimeError(f"the {deployment} did not free held streams after their hold ({hold_s} s)")
    return {"cancelled": n, "lost": lost, "lost_before_router": min(lost, router_held), "freed_s": None}


def summarize(bursts: list[dict]) -> dict:
    """Sums over bursts; ``median_free_s``: from the last cancellation to an idle engine, bursts
    that lost none."""
    freed = [b["freed_s"] for b in bursts if b["freed_s"] is not None]
    lost = sum(b["lost"] for b in bursts)
    before = sum(b["lost_before_router"] for b in bursts)
    return {"cancelled": sum(b["cancelled"] for b in bursts), "lost": lost, "lost_before_router": before,
            "lost_after_router": lost - before, "median_free_s": statistics.median(freed) if freed else None}


def format_report(report: dict) -> str:
    lines = [f"{'settle s':>8} {'path':>12} {'cancelled':>9} {'lost':>5} {'before Router':>13} "
             f"{'median free s':>13}"]
    for settle, by_path in report["settles"].items():
        for path, s in by_path.items():
            med = "-" if s["median_free_s"] is None else f"{s['median_free_s']:.3f}"
            lines.append(f"{settle:>8} {path:>12} {s['cancelled']:>9} {s['lost']:>5} "
                         f"{s['lost_before_router']:>13} {med:>13}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import grpc

    from cluster.api import stubs
    from deployments.local import local_service

    try:
        settles = [float(x) for x in args.settle.split(",") if x.strip()]
    except ValueError:
        print(f"--settle: comma-separated seconds, got {args.settle!r}", file=sys.stderr)
        return 2
    if not settles or min(settles) < 0 or args.rounds < 1 or args.streams < 1 or args.hold_s <= args.free_timeout_s:
        print("--settle needs values >= 0, --rounds and --streams >= 1, and --hold-s > --free-timeout-s "
              "(a hold shorter than the wait would free a missed cancellation by itself)", file=sys.stderr)
        return 2
    outcomes: dict[float, dict[str, list[dict]]] = {s: {p: [] for p in PATHS} for s in settles}
    t0 = time.monotonic()
    with local_service(service_config(args.hold_s)) as (addr, app):
        import ray

        ray_version = ray.__version__
        with grpc.insecure_channel(addr) as channel:
            stub, pb2 = stubs.generation_grpc().GenerationStub(channel), stubs.generation_pb2()
            md = [("application", app)]
            for r in range(args.rounds):
                for settle in settles:
                    for path in PATHS:
                        outcomes[settle][path].append(cancel_burst(
                            stub, pb2, md, path, args.streams, settle, args.free_timeout_s, args.hold_s))
                print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    report = {"rounds": args.rounds, "streams": args.streams, "hold_s": args.hold_s, "free_timeout_s": args.free_timeout_s,
              "ray_version": ray_version, "elapsed_s": time.monotonic() - t0,
              "settles": {f"{s:g}": {p: summarize(o) for p, o in by_path.items()}
                          for s, by_path in outcomes.items()}}
    print(format_report(report), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0
