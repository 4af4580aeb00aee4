"""`specserve map`: map a sample of your traffic — where speculation pays, per segment and
concurrency — and write a calibrated serve config, Helm values, map.json and a report with plots.

Owns: the arguments. The phases live in ``cluster.mapper`` (``cluster.mapper.run``)."""
from __future__ import annotations

import argparse
from pathlib import Path

from cluster.common.errors import InvalidRequestError


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"--concurrency: expected comma-separated integers, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("map", help="map your traffic: crossover per segment, plots, a calibrated serve config")
    p.add_argument("--traffic", type=Path, required=True,
                   help="JSONL file (rows as `generate --prompts` takes them) or a directory of them")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--config", type=Path, default=None,
                   help="Serve config to map and start (default deployments/serve_config.yaml); with "
                        "--addr, the running service's config")
    p.add_argument("--addr", default=None, help="sweep a running service instead of starting one")
    p.add_argument("--app", default="specserve", help="Serve application name (with --addr)")
    p.add_argument("--token", default=None, help="bearer token of the service (with --addr)")
    p.add_argument("--quick", action="store_true",
                   help="sample: 4 rows per segment, 4 requests per cell, 32 tokens, concurrency up to 16, "
                        "at most 15 minutes")
    p.add_argument("--max-minutes", type=float, default=None, help="bound the whole run; a partial map is written")
    p.add_argument("--drafters", default=None,
                   help="comma-separated drafters to profile (default: the config's, ngram, portfolio, eagle)")
    p.add_argument("--k", type=int, default=4, help="fixed K of the profile (α measured at positions 1..K)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="sweep levels")
    p.add_argument("--requests", type=int, default=16, help="requests per sweep cell (at least the concurrency)")
    p.add_argument("--rows-per-segment", type=int, default=16, help="rows sampled per segment")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on each row's max_tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the row sample")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cluster.mapper.run import MapPlan, map_workload

    plan = MapPlan(traffic=args.traffic, out=args.out, config=args.config, addr=args.addr, app_name=args.app,
                   token=args.token, quick=args.quick, max_minutes=args.max_minutes,
                   drafters=[d.strip() for d in args.drafters.split(",") if d.strip()] if args.drafters else None,
                   k=args.k, levels=_ints(args.concurrency), requests=args.requests,
                   rows_per_segment=args.rows_per_segment, max_tokens=args.max_tokens, seed=args.seed,
                   progress=not args.no_progress)
    state = map_workload(plan)
    if state.get("interrupted"):
        return 130
    return 1 if state.get("failed") else 0
