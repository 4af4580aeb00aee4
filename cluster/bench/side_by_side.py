"""What the single-request, side-by-side engine benchmarks share (``bench prediction``,
``bench logprobs``, ``bench shaping``): their common flags, loading the target with the asked torch threads, the
median they report, and the report's head (model, drafter, rounds, threads, lossless and the runs
that were not) with writing it out.

Owns: those shared pieces only — and, for the benchmarks that run each prompt on both paths
(``logprobs``, ``shaping``), the two engines and the walk over rounds, segments and prompts.
Ignores: what each benchmark runs and tabulates.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cluster.common.prompt_rows import DEFAULT_WORKLOADS


def add_side_by_side_arguments(p: argparse.ArgumentParser, segments: str, drafter_help: str) -> None:
    p.add_argument("--model", default="default", help="target model source (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    p.add_argument("--segments", default=segments, help="comma-separated segment names")
    p.add_argument("--prompts-per-segment", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96, help="cap on each row's max_tokens")
    p.add_argument("--drafter", default="portfolio", help=drafter_help)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", type=Path, required=True, help="output JSON file")


def load_target(args: argparse.Namespace):
    """(the target model, the segments asked): torch threads set first."""
    import torch

    from cluster.common.config import EngineConfig
    from cluster.models.load import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model, EngineConfig()), [s.strip() for s in args.segments.split(",") if s.strip()]


def both_paths(target, drafter: str) -> dict:
    """{"plain": an engine without drafts, "spec": one drafting with ``drafter`` at auto K}."""
    from cluster.bench.timed_run import engine_for
    from cluster.common.config import SpecConfig

    return {"plain": engine_for(target), "spec": engine_for(target, SpecConfig(drafter=drafter, num_draft_tokens="auto"))}


def prompt_walk(args: argparse.Namespace, target, segments: list[str], variants: tuple[str, ...]):
    """(round, segment, row, prompt ids, max_tokens, the variants in this round's rotating order)
    for every round, segment and prompt asked."""
    from cluster.common.prompt_rows import read_prompt_rows
    from cluster.models.tokenizer import prompt_token_ids

    for rnd in range(args.rounds):
        order = list(variants[rnd % len(variants):] + variants[: rnd % len(variants)])
        for seg in segments:
            for row in read_prompt_rows(args.workloads / f"{seg}.jsonl", args.prompts_per_segment):
                max_tokens = min(int(row.get("max_tokens", args.max_tokens)), args.max_tokens)
                yield rnd, seg, row, prompt_token_ids(target.tokenizer, row), max_tokens, order


def ratio_text(v: float | None) -> str:
    """A table cell of a ratio ("-": nothing measured)."""
    return "-" if v is None else f"{v:.3f}"


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def report(args: argparse.Namespace, benchmark: str, seconds: float, mismatches: list[str], table: dict,
           runs: list[dict], **extra) -> dict:
    import torch

    return {"benchmark": benchmark, "model": args.model, "drafter": args.drafter, **extra, "rounds": args.rounds,
            "prompts_per_segment": args.prompts_per_segment, "max_tokens": args.max_tokens,
            "threads": torch.get_num_threads(), "seconds": round(seconds, 1), "lossless": not mismatches,
            "mismatches": mismatches, "table": table, "runs": runs}


def write_report(args: argparse.Namespace, report_: dict, table_text: str) -> int:
    """Write the JSON, print the table; the exit status (1 when a run was not lossless)."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report_, indent=2))
    print(table_text)
    return 1 if report_["mismatches"] else 0
