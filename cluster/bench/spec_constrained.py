"""`specserve bench spec --constrained`: structured output, plain vs speculative, at concurrency 1.

Owns: on prompt rows that carry a ``json_schema`` (the ``json`` workload segment), running side
by side on one loaded target: unconstrained plain and n-gram decoding (reference), constrained
plain decoding, and constrained speculative decoding (n-gram drafts cut by the grammar, forced
tokens as free drafts — what a SpecEngine does with a constrained request when the Router's
``grammar_speculation`` is on); checking every constrained output parses and validates
(``jsonschema``); timing the grammar path (``cluster.bench.grammar_timing``); the goals of issue
17; the table and the JSON. Ignores: regex constraints, model drafters (their drafts are not
masked yet), the service path.

Method (as ``bench spec``): every method runs once per prompt, back to back, ``--repeats`` times
round-robin, the median-time run counts. speedup = median over prompts of the constrained plain
wall-clock / the method's (whole request). tokens/s = tokens / wall summed over prompts. α =
accepted / draft tokens (forced tokens included), ``alpha_without_forced`` leaves them out of
both. mask share = time in the grammar path (mask, draft walk, forced tokens, accept, -inf fill,
matcher creation) / wall time of the request, median over prompts; ``grammar_us_per_token`` the
same time per output token; ``per_prompt`` each prompt's wall, tokens and grammar seconds (the
per-prompt ratios can be recomputed from the JSON).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from cluster.bench.spec import DEFAULT_DRAFTERS, SEGMENTS, _engine, _med, _r, run_ours
from cluster.common.prompt_rows import read_prompt_rows

GOAL_SPEEDUP = 1.5  # constrained speculative vs constrained plain, json segment
GOAL_MASK_SHARE = 0.05  # grammar path <= 5% of a decode step
CONSTRAINED_SEGMENTS = ("json",)
REFERENCE = "plain+grammar"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _methods(args) -> list[tuple[str, object, bool]]:
    """(name, SpecConfig | None, constrained) for every method, in run order."""
    from cluster.common.config import SpecConfig

    k = args.ngram_k
    return [("plain", None, False),
            (f"ngram/k{k}", SpecConfig(drafter="ngram", num_draft_tokens=k), False),
            (REFERENCE, None, True),
            (f"ngram/k{k}+grammar", SpecConfig(drafter="ngram", num_draft_tokens=k), True),
            ("ngram/auto+grammar", SpecConfig(drafter="ngram", num_draft_tokens="auto"), True)]


def check_options(args: argparse.Namespace) -> str | None:
    """An error message for an option the constrained bench cannot honour: drafters other than
    n-gram (the default list of every drafter means the n-gram one here; model drafters draft
    without the grammar mask yet) and the options of the model-drafter and HF rows."""
    kinds = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if kinds not in (list(DEFAULT_DRAFTERS), ["ngram"]):
        return f"--constrained runs the n-gram drafter only; got --drafters {args.drafters}"
    given = [opt for opt, on in (("--self-layers", args.self_layers is not None),
                                 ("--draft-layers", args.draft_layers is not None),
                                 ("--hf-auto", args.hf_auto)) if on]
    if given:
        return f"--constrained has no model-drafter or Hugging Face rows: {', '.join(given)} does not apply"
    return None


def validate_output(text: str, schema: dict) -> str | None:
    """None when ``text`` is JSON that validates against ``schema``, else why not."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message}"
    return None


def _request(rid: str, ids: list[int], max_tokens: int, segment: str, schema: dict | None):
    from cluster.common.request import Constraint, ConstraintKind, GenerationRequest, SamplingParams

    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)) if schema is not None else None
    return GenerationRequest(rid, list(ids), SamplingParams(max_tokens=max_tokens), segment=segment,
                             constraint=constraint)


def _forced_tokens(engine, segment: str) -> int:
    """Jump-forward tokens the engine's speculation counted for ``segment`` (0 without speculation)."""
    from cluster.common.request import SpecStats

    spec = engine.spec
    return 0 if spec is None else spec.segment_stats.get(segment, SpecStats()).forced_tokens


def _one(engine, clock, rid, ids, max_tokens, segment, schema) -> dict:
    """One request through ``engine`` -> its Run plus the grammar time and forced tokens."""
    before = clock.snapshot()
    forced0 = _forced_tokens(engine, segment)
    run = run_ours(engine, _request(rid, ids, max_tokens, segment, schema))
    spent = clock.since(before)
    forced = _forced_tokens(engine, segment) - forced0
    return {"run": run, "grammar_s": sum(spent["seconds"].values()), "grammar": spent, "forced": forced}


def summarize_method(name: str, got: list[dict], reference: list[dict], row_ids: list[str],
                     texts: list[str], schemas: list[dict], plain_ids: list[list[int]] | None) -> dict:
    """One method's row over a segment's prompts (``got``/``reference`` per prompt, in order)."""
    runs = [g["run"] for g in got]
    drafted = sum(r.draft_tokens for r in runs)
    accepted = sum(r.accepted_tokens for r in runs)
    forced = sum(g["forced"] for g in got)
    wall = sum(r.wall_s for r in runs)
    tokens = sum(r.tokens for r in runs)
    problems = [validate_output(t, s) for t, s in zip(texts, schemas)]
    ops: dict[str, float] = {}
    for g in got:
        for op, s in g["grammar"]["seconds"].items():
            ops[op] = ops.get(op, 0.0) + s
    row = {
        "constrained": name.endswith("+grammar"),
        "speedup": _r(_med([ref["run"].wall_s / g["run"].wall_s for ref, g in zip(reference, got)])),
        "tokens_per_s": _r(tokens / wall if wall else None, 2),
        "ms_per_token": _r(_med([1e3 * r.wall_s / max(r.tokens, 1) for r in runs]), 3),
        "tokens": tokens,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "forced_tokens": forced,
        "acceptance_rate": _r(accepted / drafted) if drafted else None,
        "alpha_without_forced": _r((accepted - forced) / (drafted - forced)) if drafted > forced else None,
        "mean_acceptance_length": _r((accepted + sum(r.drafts for r in runs)) / sum(r.drafts for r in runs))
        if any(r.drafts for r in runs) else None,
        "mask_share": _r(_med([g["grammar_s"] / g["run"].wall_s for g in got])),
        "grammar_us_per_token": _r(1e6 * sum(g["grammar_s"] for g in got) / max(tokens, 1), 1),
        "grammar_ms_by_operation": {op: _r(1e3 * s, 3) for op, s in ops.items()},
        "valid_outputs": sum(p is None for p in problems),
        "invalid_outputs": {rid: p for rid, p in zip(row_ids, problems) if p is not None},
        "outputs_equal_constrained_plain": sum(a == r.ids for a, r in zip(plain_ids, runs)) if plain_ids else None,
        "per_prompt": {rid: {"wall_s": _r(g["run"].wall_s), "tokens": g["run"].tokens, "grammar_s": _r(g["grammar_s"], 5)}
                       for rid, g in zip(row_ids, got)},
    }
    return row


def goals(rows: dict) -> dict:
    spec = {n: r for n, r in rows.items() if r["constrained"] and n != REFERENCE}
    speedups = {n: r["speedup"] for n, r in spec.items()}
    best = max(speedups.items(), key=lambda kv: kv[1] or 0) if speedups else None
    shares = {n: r["mask_share"] for n, r in rows.items() if r["constrained"]}
    worst = max(shares.items(), key=lambda kv: kv[1] or 0) if shares else None
    invalid = {n: len(r["invalid_outputs"]) for n, r in rows.items() if r["constrained"]}
    return {
        "constrained_spec_1_5x": {"goal": f">= {GOAL_SPEEDUP}x constrained plain (json)", "measured": speedups,
                                  "best": best, "pass": bool(best) and (best[1] or 0) >= GOAL_SPEEDUP},
        "mask_share_5pct": {"goal": f"grammar path <= {GOAL_MASK_SHARE:.0%} of step time", "worst": worst,
                            "pass": bool(worst) and (worst[1] or 0) <= GOAL_MASK_SHARE},
        "no_invalid_outputs": {"goal": "every constrained output validates", "measured": invalid,
                               "pass": bool(invalid) and not any(invalid.values())},
    }


def run_constrained(args: argparse.Namespace) -> int:
    import torch

    from cluster.bench.grammar_timing import timed_grammar
    from cluster.models.tokenizer import prompt_token_ids
    from cluster.common.config import EngineConfig
    from cluster.models.load import load_model

    problem = check_options(args)
    if problem:
        _log(problem)
        return 2
    segments = [s.strip() for s in args.segments.split(",") if s.strip()]
    if segments == list(SEGMENTS):  # the default: every segment; constrained means json
        segments = list(CONSTRAINED_SEGMENTS)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_by_seg = {}
    for seg in segments:
        rows = read_prompt_rows(args.workloads / f"{seg}.jsonl", args.prompts_per_segment)
        missing = [r["id"] for r in rows if not isinstance(r.get("json_schema"), dict)]
        if missing:
            _log(f"--constrained needs a json_schema on every row; {seg} rows without one: {missing[:3]}")
            return 2
        rows_by_seg[seg] = rows
    target = load_model(args.model, EngineConfig())
    tok = target.tokenizer
    eos = set(target.eos_token_ids)
    methods = _methods(args)
    engines = {name: _engine(target, cfg) for name, cfg, _ in methods}
    report_segments, outputs = {}, {}
    t_start = time.perf_counter()
    with timed_grammar(list(engines.values())) as clock:
        seg0 = segments[0]
        warm = rows_by_seg[seg0][0]
        warm_ids = prompt_token_ids(tok, warm)
        for name, _, constrained in methods:  # tokenizer table, grammar cache, first-call costs
            _one(engines[name], clock, f"warm-{name}", warm_ids, 8, seg0, warm["json_schema"] if constrained else None)
        for seg, rows in rows_by_seg.items():
            got: dict[str, list[dict]] = {name: [] for name, _, _ in methods}
            for row in rows:
                ids = prompt_token_ids(tok, row)
                max_tokens = min(int(row.get("max_tokens", args.max_tokens)), args.max_tokens)
                reps: dict[str, list[dict]] = {name: [] for name in got}
                for rep in range(max(1, args.repeats)):
                    for name, _, constrained in methods:
                        reps[name].append(_one(engines[name], clock, f"{row['id']}-{name}-{rep}", ids, max_tokens,
                                               seg, row["json_schema"] if constrained else None))
                for name, rs in reps.items():
                    got[name].append(sorted(rs, key=lambda g: g["run"].wall_s)[(len(rs) - 1) // 2])
                _log(f"[{time.perf_counter() - t_start:7.1f}s] {seg} {row['id']}: " + " ".join(
                    f"{n}={1e3 * g[-1]['run'].wall_s / max(g[-1]['run'].tokens, 1):.1f}" for n, g in got.items())
                     + " ms/token")
            schemas = [r["json_schema"] for r in rows]
            plain_ids = [g["run"].ids for g in got[REFERENCE]]
            row_ids = [r["id"] for r in rows]
            seg_rows = {}
            for name, _, constrained in methods:
                texts = [tok.decode([t for t in g["run"].ids if t not in eos]) for g in got[name]]
                seg_rows[name] = summarize_method(name, got[name], got[REFERENCE], row_ids, texts, schemas,
                                                  plain_ids if constrained else None)
                if name == REFERENCE:
                    outputs[seg] = dict(zip(row_ids, texts))
            report_segments[seg] = seg_rows
    report = {
        "model": target.name,
        "config": {"constrained": True, "segments": segments, "methods": [m[0] for m in methods],
                   "reference": REFERENCE, "prompts_per_segment": args.prompts_per_segment,
                   "repeats": args.repeats, "max_tokens_cap": args.max_tokens, "ngram_k": args.ngram_k,
                   "threads": torch.get_num_threads(), "concurrency": 1, "greedy": True,
                   "constraint": "each row's json_schema"},
        "segments": report_segments,
        "summary": {seg: goals(rows) for seg, rows in report_segments.items()},
        "constrained_plain_outputs": outputs,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    write_json(args.json, report)
    print(format_table(report))
    return 0


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def _fmt(x, nd=2) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def format_table(report: dict) -> str:
    cols = ("speedup", "tok/s", "ms/tok", "α", "α-forced", "forced", "mask %", "µs/tok", "valid", "=plain")
    lines = [f"{'segment':<8}{'method':<22}" + "".join(f"{c:>9}" for c in cols)]
    f = _fmt
    for seg, rows in report["segments"].items():
        n = report["config"]["prompts_per_segment"]
        for name, r in rows.items():
            vals = (f(r["speedup"]), f(r["tokens_per_s"], 1), f(r["ms_per_token"], 1), f(r["acceptance_rate"]),
                    f(r["alpha_without_forced"]), f(r["forced_tokens"]),
                    f(None if r["mask_share"] is None else 100 * r["mask_share"], 1),
                    f(r["grammar_us_per_token"], 0), f"{r['valid_outputs']}/{n}",
                    f(r["outputs_equal_constrained_plain"]))
            lines.append(f"{seg:<8}{name:<22}" + "".join(f"{v:>9}" for v in vals))
        lines.append("")
        for goal, g in report["summary"][seg].items():
            lines.append(f"{'PASS' if g['pass'] else 'FAIL'}  {goal}: {g['goal']}; "
                         f"{'best' if 'best' in g else 'worst' if 'worst' in g else 'measured'} "
                         f"{g.get('best', g.get('worst', g.get('measured')))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from cluster.bench.spec import add_arguments

    p = argparse.ArgumentParser(prog="specserve bench spec --constrained", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args.constrained = True
    return run_constrained(args)


if __name__ == "__main__":
    raise SystemExit(main())
