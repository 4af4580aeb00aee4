"""Per-step profile of one constrained request on the speculative path (a diagnostic, not a bench).

Owns: running one prompt row under its constraint through one speculating engine and, per engine
step, what was drafted (forced tokens, the drafter's tokens), what was accepted, and where the
step's time went: schedule (K planning, forced tokens), propose (drafter + grammar walk),
forward, verify (masks + rejection sampling), commit (KV rollback, grammar accept,
detokenizing); the grammar path timed on its own by ``cluster.bench.grammar_timing`` (its
time overlaps the phases it runs in). Totals: target passes, tokens per pass, α per draft
position for the forced and the drafter's tokens apart. Ignores: comparing methods (``bench
spec --constrained`` does that side by side).

    python -m cluster.bench.grammar_profile --segment json --row json-000 --drafter ngram --k 4
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cluster.common.prompt_rows import DEFAULT_WORKLOADS
from cluster.common.prompt_rows import row_constraint

PHASES = ("_schedule", "_propose", "_forward", "_verify", "_commit")


def _row(args) -> dict:
    from cluster.common.prompt_rows import read_prompt_rows

    path = args.workloads / f"{args.segment}.jsonl"
    if args.segment == "regex" and not path.exists():
        path = Path(__file__).with_name("regex_prompts.jsonl")
    rows = read_prompt_rows(path)
    return next(r for r in rows if args.row in (None, r["id"]))


def profile(engine, clock, request) -> dict:
    """Run ``request`` alone through ``engine`` with its step phases timed -> the profile."""
    steps: list[dict] = []
    cur: dict = {}
    originals = {p: getattr(engine, p) for p in PHASES}

    def timed(name, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            cur[name[1:]] = time.perf_counter() - t0
            if name == "_propose":
                d = out.get(request.request_id)
                cur["k"], cur["forced"] = (0, 0) if d is None else (d.k, d.num_forced)
            if name == "_verify" and out:
                v = out[0]
                cur["accepted"] = v[1] if isinstance(v, tuple) else None
            return out
        return run

    for p in PHASES:
        setattr(engine, p, timed(p, originals[p]))
    ids: list[int] = []
    t_start = time.perf_counter()
    try:
        engine.add_request(request)
        while engine.has_work():
            cur.clear()
            g0 = clock.total_s
            t0 = time.perf_counter()
            for out in engine.step():
                ids += out.new_token_ids
            cur["wall"] = time.perf_counter() - t0
            cur["grammar"] = clock.total_s - g0
            steps.append(dict(cur))
    finally:
        for p in PHASES:
            setattr(engine, p, originals[p])
    wall = time.perf_counter() - t_start
    return summarize(steps, ids, wall)


def summarize(steps: list[dict], ids: list[int], wall: float) -> dict:
    decode = steps[1:]  # the first step is the prefill
    forced_pos: list[list[int]] = []  # [position] -> [accepted, drafted] over forced tokens
    drafter_pos: list[list[int]] = []
    for s in decode:
        k, f, a = s.get("k", 0), s.get("forced", 0), s.get("accepted")
        if not k or a is None:
            continue
        for j in range(k):  # position j reached iff every earlier draft token was accepted
            if j > a:
                break
            table, i = (forced_pos, j) if j < f else (drafter_pos, j - f)
            while len(table) <= i:
                table.append([0, 0])
            table[i][1] += 1
            table[i][0] += j < a
    ms = {p[1:]: round(1e3 * sum(s.get(p[1:], 0.0) for s in steps), 2) for p in PHASES}
    ms["grammar (overlaps)"] = round(1e3 * sum(s["grammar"] for s in steps), 2)
    ms["wall"] = round(1e3 * wall, 2)
    return {
        "tokens": len(ids),
        "target_passes": len(steps),
        "tokens_per_decode_pass": round((len(ids) - 1) / max(len(decode), 1), 3),
        "forced_drafted": sum(s.get("forced", 0) for s in decode),
        "drafter_drafted": sum(s.get("k", 0) - s.get("forced", 0) for s in decode),
        "accepted": sum(s.get("accepted") or 0 for s in decode),
        "alpha_forced_by_position": [round(a / d, 3) for a, d in forced_pos],
        "alpha_drafter_by_position": [round(a / d, 3) for a, d in drafter_pos],
        "reached_drafter_by_position": [d for _, d in drafter_pos],
        "ms": ms,
        "ms_per_decode_pass": {p[1:]: round(1e3 * sum(s.get(p[1:], 0.0) for s in decode) / max(len(decode), 1), 3)
                               for p in PHASES},
        "steps": [{k: (round(1e3 * v, 3) if isinstance(v, float) else v) for k, v in s.items()} for s in steps],
        "ids": ids,
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from cluster.bench.grammar_timing import timed_grammar
    from cluster.bench.timed_run import engine_for
    from cluster.common.config import EngineConfig, SpecConfig
    from cluster.common.request import GenerationRequest, SamplingParams
    from cluster.models.load import load_model
    from cluster.models.tokenizer import prompt_token_ids

    p = argparse.ArgumentParser(prog="python -m cluster.bench.grammar_profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    p.add_argument("--segment", default="json")
    p.add_argument("--row", default=None, help="row id (default: the segment's first row)")
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--k", default="4", help="fixed K or auto")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = _row(args)
    target = load_model(args.model, EngineConfig())
    engine = engine_for(target, SpecConfig(drafter=args.drafter, num_draft_tokens=args.k))
    ids = prompt_token_ids(target.tokenizer, row)
    max_tokens = min(int(row.get("max_tokens", args.max_tokens)), args.max_tokens)

    def request(rid, n=max_tokens):
        return GenerationRequest(rid, list(ids), SamplingParams(max_tokens=n), segment=row["segment"],
                                 constraint=row_constraint(row))

    with timed_grammar([engine]) as clock:
        # tokenizer table, grammar cache, first calls; short: a learning drafter must not learn the answer
        profile(engine, clock, request("warm", 4))
        out = profile(engine, clock, request(row["id"]))
    out["row"], out["drafter"], out["k"] = row["id"], args.drafter, args.k
    out["text"] = target.tokenizer.decode([t for t in out["ids"] if t not in set(target.eos_token_ids)])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    brief = {k: v for k, v in out.items() if k not in ("steps", "ids")}
    print(json.dumps(brief, indent=1))
    for s in out["steps"]:
        print(" ".join(f"{k}={v}" for k, v in s.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
