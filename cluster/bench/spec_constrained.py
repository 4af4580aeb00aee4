"""`specserve bench spec --constrained`: structured output, plain vs speculative, at concurrency 1.

Owns: on prompt rows that carry a constraint — the ``json`` workload segment (each row's
``json_schema``) and the ``regex`` segment (``cluster/bench/regex_prompts.jsonl``, committed here:
dates, phone numbers, enumerations, CSV and key=value lines, e-mail addresses, times, lists; a
``regex.jsonl`` in ``--workloads`` takes its place) — running side by side on one loaded target:
unconstrained plain and n-gram decoding (reference), constrained plain decoding, jump-forward
alone (forced tokens as free drafts, no drafter), and constrained speculative decoding with every
drafter the engine runs under a grammar (n-gram at a fixed K and auto K, suffix and portfolio at
auto K; ``self`` and ``draft`` model drafters on request — they draft without the mask, their
drafts cut where the grammar rejects them); checking every constrained output (``jsonschema`` /
full regex match); timing the grammar path (``cluster.bench.grammar_timing``) and the step's
phases; the goals of issue 17; the table and the JSON. Ignores: the service path.

Method (as ``bench spec``): every method runs once per prompt, back to back, ``--repeats`` times
round-robin (suffix and portfolio once: a second run would copy the first's answer), the
median-time run counts. speedup = median over prompts of the constrained plain
wall-clock / the method's (whole request). tokens/s = tokens / wall summed over prompts. α =
accepted / draft tokens (forced tokens included), ``alpha_without_forced`` leaves them out of
both. mask share = time in the grammar path (mask, draft walk, forced tokens, accept, -inf fill,
matcher creation) / wall time of the request, median over prompts; ``grammar_us_per_token`` the
same time per output token; ``per_prompt`` each prompt's wall, tokens and grammar seconds (the
per-prompt ratios can be recomputed from the JSON). ``ms_by_phase`` splits the wall time summed
over prompts: target forwards, drafter, verification (rejection sampling with the masks), the
grammar path outside verification, and the rest (scheduling, commit, detokenizing);
``target_passes`` counts forwards, ``alpha_by_position`` is accepted / drafted per draft position.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from cluster.bench.spec import DEFAULT_DRAFTERS, SEGMENTS, runs_per_prompt
from cluster.bench.spec_rows import median_of, position_counts, rounded
from cluster.bench.timed_run import engine_for, run_ours
from cluster.common.prompt_rows import read_prompt_rows, row_constraint

GOAL_SPEEDUP = 1.5  # constrained speculative vs constrained plain, json segment
GOAL_MASK_SHARE = 0.05  # grammar path <= 5% of a decode step
CONSTRAINED_SEGMENTS = ("json", "regex")
REFERENCE = "plain+grammar"
REGEX_PROMPTS = Path(__file__).with_name("regex_prompts.jsonl")
MODEL_FREE_DRAFTERS = ("ngram", "suffix", "portfolio")  # what the default drafter list means here
CONSTRAINED_DRAFTERS = MODEL_FREE_DRAFTERS + ("self", "draft")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _kinds(args) -> list[str]:
    kinds = [d.strip() for d in args.drafters.split(",") if d.strip()]
    return list(MODEL_FREE_DRAFTERS) if kinds == list(DEFAULT_DRAFTERS) else kinds


def _methods(args, model_drafters: dict | None = None) -> list[tuple[str, object, bool, object]]:
    """(name, SpecConfig | None, constrained, proposer | None) for every method, in run order.
    ``model_drafters``: "self" -> L, "draft" -> (layers, proposer factory), when asked for."""
    from cluster.common.config import SpecConfig

    k, kinds, md = args.ngram_k, _kinds(args), model_drafters or {}
    out = [("plain", None, False, None),
           (f"ngram/k{k}", SpecConfig(drafter="ngram", num_draft_tokens=k), False, None),
           (REFERENCE, None, True, None),
           # fixed K = 0: no drafter at all, only the tokens the grammar forces
           ("jump-forward+grammar", SpecConfig(drafter="ngram", num_draft_tokens=0), True, None)]
    if "ngram" in kinds:
        out += [(f"ngram/k{k}+grammar", SpecConfig(drafter="ngram", num_draft_tokens=k), True, None),
                ("ngram/auto+grammar", SpecConfig(drafter="ngram", num_draft_tokens="auto"), True, None)]
    for name in ("suffix", "portfolio"):
        if name in kinds:
            out.append((f"{name}/auto+grammar", SpecConfig(drafter=name, num_draft_tokens="auto"), True, None))
    if "self" in md:
        L = md["self"]
        out.append((f"self:{L}/k{args.model_k}+grammar", SpecConfig(drafter=f"self:{L}", num_draft_tokens=args.model_k),
                    True, None))
    if "draft" in md:
        layers, make = md["draft"]
        out.append((f"draft-l{layers}/k{args.model_k}+grammar",
                    SpecConfig(drafter="draft", num_draft_tokens=args.model_k), True, make()))
    return out


def check_options(args: argparse.Namespace) -> str | None:
    """An error message for an option the constrained bench cannot honour: unknown drafters
    (the default list of every drafter means the model-free ones here) and the Hugging Face
    rows (no HF peer runs under a grammar)."""
    bad = [d for d in _kinds(args) if d not in CONSTRAINED_DRAFTERS]
    if bad:
        return f"--constrained runs the drafters {', '.join(CONSTRAINED_DRAFTERS)}; got --drafters {args.drafters}"
    if args.hf_auto:
        return "--constrained has no Hugging Face rows: --hf-auto does not apply"
    kinds = _kinds(args)
    for opt, on, needs in (("--self-layers", args.self_layers is not None, ("self", "draft")),
                           ("--draft-layers", args.draft_layers is not None, ("draft",))):
        if on and not any(n in kinds for n in needs):
            return f"{opt} applies to the {' / '.join(needs)} drafter, which --drafters does not name"
    return None


def validate_row_output(text: str, row: dict) -> str | None:
    """None when ``text`` satisfies the row's constraint, else why not."""
    if isinstance(row.get("json_schema"), dict):
        return validate_output(text, row["json_schema"])
    if re.fullmatch(row["regex"], text) is None:
        return f"does not match {row['regex']!r}"
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


def _request(rid: str, ids: list[int], max_tokens: int, segment: str, constraint):
    from cluster.common.request import GenerationRequest, SamplingParams

    return GenerationRequest(rid, list(ids), SamplingParams(max_tokens=max_tokens), segment=segment,
                             constraint=constraint)


def _forced_tokens(engine, segment: str) -> int:
    """Jump-forward tokens the engine's speculation counted for ``segment`` (0 without speculation)."""
    from cluster.common.request import SpecStats

    spec = engine.spec
    return 0 if spec is None else spec.segment_stats.get(segment, SpecStats()).forced_tokens


PHASES = ("forward", "draft", "verify")  # SpecTiming fields: plain + verify forwards, propose, verify


def _phase_clock(engine) -> dict[str, float] | None:
    t = getattr(engine.spec, "timing", None)
    if t is None:
        return None
    return {"forward": t.verify_forward_s + t.plain_forward_s, "draft": t.propose_s, "verify": t.verify_s}


def _one(engine, clock, rid, ids, max_tokens, segment, constraint) -> dict:
    """One request through ``engine`` -> its Run plus the grammar time, forced tokens and the
    time per phase (None for an engine without speculation: its forwards are not timed)."""
    before, forced0, phases0 = clock.snapshot(), _forced_tokens(engine, segment), _phase_clock(engine)
    run = run_ours(engine, _request(rid, ids, max_tokens, segment, constraint))
    spent = clock.since(before)
    phases1 = _phase_clock(engine)
    phases = None if phases0 is None else {p: phases1[p] - phases0[p] for p in PHASES}
    return {"run": run, "grammar_s": sum(spent["seconds"].values()), "grammar": spent,
            "forced": _forced_tokens(engine, segment) - forced0, "phases": phases}


def _phase_ms(got: list[dict], wall: float) -> dict | None:
    """Wall time summed over prompts split into phases (ms): forward (every target pass),
    draft (the drafter's call; a model drafter's masks under the grammar are counted here and
    in grammar both), verify
    (rejection sampling, the -inf fill on the verified rows included), grammar (the grammar path
    but the -inf fill: masks, draft walks, forced tokens, accepts) and other (scheduling, commit,
    detokenizing, a plain step's -inf fill)."""
    if any(g["phases"] is None for g in got):
        return None
    out = {p: sum(g["phases"][p] for g in got) for p in PHASES}
    out["grammar"] = sum(g["grammar_s"] - g["grammar"]["seconds"]["apply"] for g in got)
    out["other"] = wall - sum(out.values())
    return {p: rounded(1e3 * v, 1) for p, v in out.items()}


def _per_position(runs) -> list[float | None]:
    acc, drafted = position_counts(runs)
    return [rounded(a / d, 3) if d else None for a, d in zip(acc, drafted)]


def summarize_method(name: str, got: list[dict], reference: list[dict], rows: list[dict],
                     texts: list[str], plain_ids: list[list[int]] | None) -> dict:
    """One method's row over a segment's prompts (``got``/``reference`` per prompt, in order)."""
    runs = [g["run"] for g in got]
    row_ids = [r["id"] for r in rows]
    drafted = sum(r.draft_tokens for r in runs)
    accepted = sum(r.accepted_tokens for r in runs)
    forced = sum(g["forced"] for g in got)
    wall = sum(r.wall_s for r in runs)
    tokens = sum(r.tokens for r in runs)
    passes = sum(1 + len(r.decode_steps) + len(r.verify_steps) for r in runs)
    problems = [validate_row_output(t, row) for t, row in zip(texts, rows)]
    ops: dict[str, float] = {}
    for g in got:
        for op, sec in g["grammar"]["seconds"].items():
            ops[op] = ops.get(op, 0.0) + sec
    return {
        "constrained": name.endswith("+grammar"),
        "speedup": rounded(median_of([ref["run"].wall_s / g["run"].wall_s for ref, g in zip(reference, got)])),
        "tokens_per_s": rounded(tokens / wall if wall else None, 2),
        "ms_per_token": rounded(median_of([1e3 * r.wall_s / max(r.tokens, 1) for r in runs]), 3),
        "tokens": tokens,
        "target_passes": passes,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "forced_tokens": forced,
        "acceptance_rate": rounded(accepted / drafted) if drafted else None,
        "alpha_without_forced": rounded((accepted - forced) / (drafted - forced)) if drafted > forced else None,
        "alpha_by_position": _per_position(runs),
        "mean_acceptance_length": rounded((accepted + sum(r.drafts for r in runs)) / sum(r.drafts for r in runs))
        if any(r.drafts for r in runs) else None,
        "mask_share": rounded(median_of([g["grammar_s"] / g["run"].wall_s for g in got])),
        "grammar_us_per_token": rounded(1e6 * sum(g["grammar_s"] for g in got) / max(tokens, 1), 1),
        "grammar_ms_by_operation": {op: rounded(1e3 * sec, 3) for op, sec in ops.items()},
        "ms_by_phase": _phase_ms(got, wall),
        "valid_outputs": sum(p is None for p in problems),
        "invalid_outputs": {rid: p for rid, p in zip(row_ids, problems) if p is not None},
        "outputs_equal_constrained_plain": sum(a == r.ids for a, r in zip(plain_ids, runs)) if plain_ids else None,
        "per_prompt": {rid: {"wall_s": rounded(g["run"].wall_s), "tokens": g["run"].tokens, "grammar_s": rounded(g["grammar_s"], 5)}
                       for rid, g in zip(row_ids, got)},
    }


def goals(rows: dict, segment: str = "json") -> dict:
    """The issue's goals judged on a segment's constrained rows (the 1.5x goal is set on json)."""
    spec = {n: r for n, r in rows.items() if r["constrained"] and n != REFERENCE}
    speedups = {n: r["speedup"] for n, r in spec.items()}
    best = max(speedups.items(), key=lambda kv: kv[1] or 0) if speedups else None
    shares = {n: r["mask_share"] for n, r in rows.items() if r["constrained"]}
    worst = max(shares.items(), key=lambda kv: kv[1] or 0) if shares else None
    invalid = {n: len(r["invalid_outputs"]) for n, r in rows.items() if r["constrained"]}
    return {
        "constrained_spec_1_5x": {"goal": f">= {GOAL_SPEEDUP}x constrained plain ({segment})", "measured": speedups,
                                  "best": best, "pass": bool(best) and (best[1] or 0) >= GOAL_SPEEDUP},
        "mask_share_5pct": {"goal": f"grammar path <= {GOAL_MASK_SHARE:.0%} of step time", "worst": worst,
                            "pass": bool(worst) and (worst[1] or 0) <= GOAL_MASK_SHARE},
        "no_invalid_outputs": {"goal": "every constrained output validates", "measured": invalid,
                               "pass": bool(invalid) and not any(invalid.values())},
    }


def read_constrained_rows(args, seg: str) -> tuple[list[dict] | None, str | None]:
    """A segment's rows, each with its constraint -> (rows, None) or (None, why not)."""
    path = args.workloads / f"{seg}.jsonl"
    if seg == "regex" and not path.exists():
        path = REGEX_PROMPTS
    if not path.exists():
        return None, f"no prompt file for segment {seg!r}: {path}"
    rows = read_prompt_rows(path, args.prompts_per_segment)
    # a grammar row would constrain too, but only a schema or a regex can be checked here
    missing = [r["id"] for r in rows if row_constraint(r) is None or r.get("grammar")]
    if missing:
        return None, f"--constrained needs a json_schema or regex on every row; {seg} rows without one: {missing[:3]}"
    return rows, None


def _model_drafters(args, target) -> dict:
    """The model drafters asked for: "self" -> L, "draft" -> (layers, proposer factory)."""
    kinds = _kinds(args)
    out: dict = {}
    if not any(k in kinds for k in ("self", "draft")):
        return out
    from cluster.speculative.layer_skip import default_self_layers

    L = args.self_layers or default_self_layers(target.runner.model.arch.num_layers)
    if "self" in kinds:
        out["self"] = L
    if "draft" in kinds:
        from cluster.common.cache_dir import cache_root
        from cluster.common.config import EngineConfig
        from cluster.models.derive import derive_truncated_draft
        from cluster.models.load import load_model
        from cluster.models.runner import ModelRunner
        from cluster.speculative.draft_model import DraftModelProposer
        from cluster.speculative.vocab_check import require_vocab_compatible

        layers = args.draft_layers or L
        draft_dir = derive_truncated_draft(target.path, layers,
                                           cache_root() / "derived" / f"{Path(target.path).name}-first{layers}")
        draft = load_model(str(draft_dir), EngineConfig())
        require_vocab_compatible(target.tokenizer, draft.tokenizer)
        out["draft"] = (layers, lambda: DraftModelProposer(ModelRunner(draft.runner.model, None, 16, 128)))
    return out


def run_constrained(args: argparse.Namespace) -> int:
    import torch

    from cluster.bench.grammar_timing import timed_grammar
    from cluster.common.config import EngineConfig
    from cluster.models.load import load_model
    from cluster.models.tokenizer import prompt_token_ids

    problem = check_options(args)
    if problem:
        _log(problem)
        return 2
    segments = [s.strip() for s in args.segments.split(",") if s.strip()]
    if segments == list(SEGMENTS):  # the default: every segment; constrained means json and regex
        segments = list(CONSTRAINED_SEGMENTS)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_by_seg = {}
    for seg in segments:
        rows, problem = read_constrained_rows(args, seg)
        if problem:
            _log(problem)
            return 2
        rows_by_seg[seg] = rows
    target = load_model(args.model, EngineConfig())
    tok = target.tokenizer
    eos = set(target.eos_token_ids)
    methods = _methods(args, _model_drafters(args, target))
    engines = {name: engine_for(target, cfg, proposer) for name, cfg, _, proposer in methods}
    report_segments, outputs = {}, {}
    t_start = time.perf_counter()
    with timed_grammar(list(engines.values())) as clock:
        for seg, rows in rows_by_seg.items():  # tokenizer table, grammar caches, first-call costs
            warm_ids = prompt_token_ids(tok, rows[0])
            for name, _, constrained, _ in methods:
                _one(engines[name], clock, f"warm-{seg}-{name}", warm_ids, 8, seg,
                     row_constraint(rows[0]) if constrained else None)
        for seg, rows in rows_by_seg.items():
            got: dict[str, list[dict]] = {name: [] for name, _, _, _ in methods}
            for row in rows:
                ids = prompt_token_ids(tok, row)
                max_tokens = min(int(row.get("max_tokens", args.max_tokens)), args.max_tokens)
                reps: dict[str, list[dict]] = {name: [] for name in got}
                for rep in range(max(1, args.repeats)):
                    for name, _, constrained, _ in methods:
                        if rep >= runs_per_prompt(name, args.repeats):
                            continue  # a learning drafter's second run would copy the first's answer
                        reps[name].append(_one(engines[name], clock, f"{row['id']}-{name}-{rep}", ids, max_tokens,
                                               seg, row_constraint(row) if constrained else None))
                for name, rs in reps.items():
                    got[name].append(sorted(rs, key=lambda g: g["run"].wall_s)[(len(rs) - 1) // 2])
                _log(f"[{time.perf_counter() - t_start:7.1f}s] {seg} {row['id']}: " + " ".join(
                    f"{n}={1e3 * g[-1]['run'].wall_s / max(g[-1]['run'].tokens, 1):.1f}" for n, g in got.items())
                     + " ms/token")
            plain_ids = [g["run"].ids for g in got[REFERENCE]]
            seg_rows = {}
            for name, _, constrained, _ in methods:
                texts = [tok.decode([t for t in g["run"].ids if t not in eos]) for g in got[name]]
                seg_rows[name] = summarize_method(name, got[name], got[REFERENCE], rows, texts,
                                                  plain_ids if constrained else None)
                if name == REFERENCE:
                    outputs[seg] = dict(zip([r["id"] for r in rows], texts))
            report_segments[seg] = seg_rows
    report = {
        "model": target.name,
        "config": {"constrained": True, "segments": segments, "methods": [m[0] for m in methods],
                   "reference": REFERENCE, "prompts_per_segment": args.prompts_per_segment,
                   "repeats": args.repeats, "max_tokens_cap": args.max_tokens, "ngram_k": args.ngram_k,
                   "model_k": args.model_k, "threads": torch.get_num_threads(), "concurrency": 1, "greedy": True,
                   "constraint": "each row's json_schema or regex", "argv": sys.argv[1:]},
        "segments": report_segments,
        "summary": {seg: goals(rows, seg) for seg, rows in report_segments.items()},
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
    cols = ("speedup", "tok/s", "ms/tok", "tok/pass", "α", "α-forced", "forced", "mask %", "µs/tok", "valid", "=plain")
    lines = [f"{'segment':<8}{'method':<24}" + "".join(f"{c:>9}" for c in cols)]
    f = _fmt
    for seg, rows in report["segments"].items():
        for name, r in rows.items():
            n = len(r["per_prompt"])
            vals = (f(r["speedup"]), f(r["tokens_per_s"], 1), f(r["ms_per_token"], 1),
                    f(r["tokens"] / max(r["target_passes"], 1)), f(r["acceptance_rate"]),
                    f(r["alpha_without_forced"]), f(r["forced_tokens"]),
                    f(None if r["mask_share"] is None else 100 * r["mask_share"], 1),
                    f(r["grammar_us_per_token"], 0), f"{r['valid_outputs']}/{n}",
                    f(r["outputs_equal_constrained_plain"]))
            lines.append(f"{seg:<8}{name:<24}" + "".join(f"{v:>9}" for v in vals))
        lines.append("")
        for goal, g in report["summary"][seg].items():
            lines.append(f"{'PASS' if g['pass'] else 'FAIL'}  {goal}: {g['goal']}; "
                         f"{'best' if 'best' in g else 'worst' if 'worst' in g else 'measured'} "
                         f"{g.get('best', g.get('worst', g.get('measured')))}")
        lines.append("")
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
