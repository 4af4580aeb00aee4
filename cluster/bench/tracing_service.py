"""Tracing overhead of the whole service at concurrency 1, real engine (not a test; prints + JSON).

One Ray cluster, two Serve apps with identical config on the default model (SmolLM2-135M,
placement ``separate``, n-gram drafter in a DraftServer): ``off`` has no telemetry, ``on``
exports every trace (sampling 1.0) over OTLP/gRPC to the real receiver in this process. One client
sends the same greedy requests to both, strictly one at a time, interleaved (the order flips every
round so that drift and warm-up hit both sides alike); per prompt we compare median end-to-end
latency on/off and report the median of the per-round paired ratios.

Run from the repository root (it reuses the test tree's Serve app harness and OTLP receiver):

    .venv/bin/python -m cluster.bench.tracing_service --rounds 10 --json .bench/tracing_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from cluster.bench import from_test_tree
from cluster.common.prompt_rows import DEFAULT_WORKLOADS

_BENCH = "cluster.bench.tracing_service"


def app_args(telemetry: dict | None) -> dict:
    small = from_test_tree("tests.deployments.harness", "SMALL", _BENCH)
    eng = {**small, "num_cpus": 0.2, "max_num_seqs": 4, "kv_cache_memory_mb": 64}
    args = {"model": "default", "drafter": "ngram", "num_draft_tokens": 4, "torch_threads": 1,
            "placement": "separate", "router_deployment": small, "spec_engine": eng, "batch_engine": eng,
            "draft_server": {**small, "host": "127.0.0.1", "timeout_s": 5.0},
            "limits": {"max_tokens": 256, "max_prompt_tokens": 1024, "max_message_bytes": 65536,
                       "max_queue": 16}}
    if telemetry:
        args["telemetry"] = telemetry
    return args


def prompts(n_per_segment: int) -> list[tuple[str, str]]:
    out = []
    for seg in ("code", "summarize", "chat"):
        with open(DEFAULT_WORKLOADS / f"{seg}.jsonl") as f:
            for line, _ in zip(f, range(n_per_segment)):
                out.append((seg, json.loads(line)["prompt"][:400]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts-per-segment", type=int, default=1)
    ap.add_argument("--json", default=".bench/tracing_overhead.json")
    a = ap.parse_args()
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "5000")  # the SDK default, stated explicitly
    work = prompts(a.prompts_per_segment)
    serve_apps = from_test_tree("tests.deployments.harness", "serve_apps", _BENCH)
    Client = from_test_tree("tests.deployments.harness", "Client", _BENCH)
    OtlpReceiver = from_test_tree("tests.telemetry.otlp_receiver", "OtlpReceiver", _BENCH)
    lat: dict[str, dict[int, list[float]]] = {"off": {}, "on": {}}
    tokens: dict[str, dict[int, list[int]]] = {"off": {}, "on": {}}
    with OtlpReceiver() as receiver:
        apps = {"off": app_args(None),
                "on": app_args({"otlp_endpoint": receiver.endpoint, "sampling_ratio": 1.0,
                                "service_name": "specserve-bench"})}
        with serve_apps(apps, timeout_s=400) as addr:
            clients = {name: Client(addr, name) for name in apps}
            for c in clients.values():
                c.wait_ready(timeout_s=300)
            for i, (_, p) in enumerate(work):  # warm-up: one request per prompt and app
                for c in clients.values():
                    c.generate(prompt=p, max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True, timeout=300)
            t_start = time.time()
            for r in range(a.rounds):
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                for i, (seg, p) in enumerate(work):
                    for name in order:
                        t0 = time.perf_counter()
                        resp = clients[name].generate(prompt=p, max_tokens=a.max_tokens, temperature=0.0,
                                                      segment=seg, ignore_eos=True, timeout=300)
                        lat[name].setdefault(i, []).append(time.perf_counter() - t0)
                        tokens[name].setdefault(i, []).append(len(resp.token_ids))
                print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
            wall = time.time() - t_start
            expected = a.rounds * len(work)
            try:  # the traced app really exported: one router span per request (+ warm-up)
                receiver.wait_for(lambda s: sum(x.name.startswith("text_completion") for x in s) >= expected,
                                  timeout=30)
            except TimeoutError:
                pass
            spans = receiver.spans
    per_prompt = []
    ratios_all = []
    for i, (seg, _) in enumerate(work):
        off, on = lat["off"][i], lat["on"][i]
        paired = [b / a_ for a_, b in zip(off, on)]
        ratios_all += paired
        per_prompt.append({"segment": seg, "output_tokens": tokens["on"][i][0],
                           "same_tokens": tokens["on"][i] == tokens["off"][i],
                           "median_off_ms": round(statistics.median(off) * 1e3, 2),
                           "median_on_ms": round(statistics.median(on) * 1e3, 2),
                           "ratio_of_medians": round(statistics.median(on) / statistics.median(off), 4),
                           "median_paired_ratio": round(statistics.median(paired), 4),
                           "off_ms": [round(x * 1e3, 2) for x in off], "on_ms": [round(x * 1e3, 2) for x in on]})
    router_spans = sum(x.name.startswith("text_completion") for x in spans)
    result = {
        "what": "e2e latency through the gRPC front door, concurrency 1, tracing off vs on (OTLP, ratio 1.0)",
        "model": "default", "placement": "separate", "drafter": "ngram", "max_tokens": a.max_tokens,
        "rounds": a.rounds, "wall_s": round(wall, 1), "load_avg": os.getloadavg(),
        "spans_received": len(spans), "router_spans_received": router_spans,
        "median_paired_ratio_all": round(statistics.median(ratios_all), 4),
        "overhead_pct_median": round((statistics.median(ratios_all) - 1) * 100, 2),
        "per_prompt": per_prompt,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2))
    print(f"{'segment':<10} {'tok':>4} {'off ms':>9} {'on ms':>9} {'on/off(med)':>12} {'paired med':>11}")
    for row in per_prompt:
        print(f"{row['segment']:<10} {row['output_tokens']:>4} {row['median_off_ms']:>9.1f} "
              f"{row['median_on_ms']:>9.1f} {row['ratio_of_medians']:>12.4f} {row['median_paired_ratio']:>11.4f}")
    print(f"all prompts: median paired on/off = {result['median_paired_ratio_all']:.4f} "
          f"({result['overhead_pct_median']:+.2f} %); spans received {len(spans)} "
          f"({router_spans} requests); load avg {result['load_avg']}")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
